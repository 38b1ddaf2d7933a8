"""The colocated hf engine reading the actor's parameter tensors instead of holding copies of its own.

With one train rank the actor's (FSDP2 shard of a) parameter is the whole tensor, so the engine replica in
the same process can point its parameters at it (`point_engine_at`). What it reads (`actor_tensors`):

- LoRA: the frozen base; each weight sync still sends the adapters (lora.py).
- A full fine-tune: every parameter. The optimizer writes them in place, so after an update the engine
  already holds the new policy; the sync copies nothing (`Policy.engine_weights` yields one empty bucket,
  whose `update_weights([])` still orders the engine after the update, drops the idle sessions' KV and
  counts the version). Only in trainer.mode=sync: in the async modes the engine would sample while the
  optimizer writes, from weights half old and half new.

The engine's model is marked borrowed (`hf_engine.BORROWED_WEIGHTS`): its sleep frees the KV cache alone and
never moves, parks or drops these tensors.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from verl_agent.engine.backends.hf_engine import BORROWED_WEIGHTS
from verl_agent.trainer.weights.lora import base_name

__all__ = ["actor_tensors", "engine_shares_weights", "point_engine_at"]


def engine_shares_weights(cfg: Any, device_type: str, world: int) -> bool:
    """Does the colocated hf engine read the actor's tensors (see the module docstring)?

    Needs one train rank (its shard is the whole tensor), the actor's parameters on the device (no
    fsdp_config.param_offload) and stored in the engine's dtype (a LoRA base in bf16 on GPU, else
    model.dtype: an fp32 actor computing in bf16 under mixed precision shares nothing with a bf16 engine).
    LoRA: adapters applied unmerged (a merge would write into the actor's base). A full fine-tune: sync
    mode (the engine never samples while the optimizer writes)."""
    arr, t = cfg.actor_rollout_ref, cfg.trainer
    r, lora = arr.rollout, arr.model.lora_rank > 0
    stored = "bfloat16" if lora and device_type == "cuda" else arr.model.dtype  # as Policy._load stores it
    if not (world == 1 and t.placement == "colocated" and r.name == "hf" and not arr.actor.fsdp_config.param_offload
            and (r.dtype or arr.model.dtype) == stored):
        return False
    return r.engine_lora_mode(device_type) == "unmerged" if lora else t.mode == "sync"


def actor_tensors(model: nn.Module, frozen_only: bool) -> dict[str, Tensor]:
    """One rank's (unsharded, world 1) actor parameters under their plain model names (a PEFT name through
    `lora.base_name`); `frozen_only`: the frozen ones (LoRA's base)."""
    return {base_name(n): (p.to_local() if hasattr(p, "to_local") else p).detach()
            for n, p in model.named_parameters() if not (frozen_only and p.requires_grad)}


def point_engine_at(engine_model: nn.Module, tensors: dict[str, Tensor]) -> None:
    """Point every parameter of the engine's model at the actor's tensor of the same name (no copy), and mark
    the model borrowed."""
    for name, p in engine_model.named_parameters():
        t = tensors.get(name)
        if t is None or t.shape != p.shape or t.dtype != p.dtype:
            raise RuntimeError(f"sharing the actor's weights: the actor has no {p.dtype} tensor of shape "
                               f"{tuple(p.shape)} named {name!r}")
        p.data = t
    setattr(engine_model, BORROWED_WEIGHTS, True)
