"""Model building blocks of a worker: load, shard with FSDP2, gather for the engine, LR schedule, critic.

FSDP2 (`fully_shard`) is applied to every decoder layer and then to the root,
so one layer's full parameters exist at a time during forward/backward. On
GPU, parameters stay fp32 (the optimizer's master copy) and compute runs in
bf16 through `MixedPrecisionPolicy`; on CPU everything is fp32 (FACTS.md:
FSDP2 CPU offload does not work on CPU, so it is not offered).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import Tensor, nn

__all__ = ["resolve_model_path", "load_causal_lm", "shard", "iter_full_param_buckets", "make_scheduler", "ValueModel"]


def resolve_model_path(path: str) -> str:
    """'tiny' = the embedded tiny model (built locally on first use); anything else is a HF id or folder."""
    if path == "tiny":
        from verl_agent.models.tiny import build_tiny

        return str(build_tiny())
    return path


def load_causal_lm(path: str, dtype: str = "float32", gradient_checkpointing: bool = False) -> nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(path), dtype=getattr(torch, dtype))
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:  # models that do not declare _no_split_modules: take the first ModuleList of blocks
        lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
        layers = list(lists[0]) if lists else []
    return layers


def shard(model: nn.Module, mesh, device_type: str, reshard_after_forward: bool = True) -> nn.Module:
    """fully_shard each decoder layer, then the root; bf16 compute with fp32 master weights on GPU."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs: dict = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if device_type == "cuda" and next(model.parameters()).dtype == torch.float32:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in _decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def iter_full_param_buckets(model: nn.Module, bucket_bytes: int = 64 << 20) -> Iterator[list[tuple[str, Tensor]]]:
    """Full (unsharded) parameters, bucket by bucket; every rank must iterate (all-gathers are collective)."""
    bucket: list[tuple[str, Tensor]] = []
    size = 0
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p.data
        bucket.append((name, full.detach()))
        size += full.numel() * full.element_size()
        if size >= bucket_bytes:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def make_scheduler(optimizer: torch.optim.Optimizer, optim_cfg, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup (lr_warmup_steps, or lr_warmup_steps_ratio of total) then constant or cosine to min_lr_ratio."""
    warmup = optim_cfg.lr_warmup_steps or int(optim_cfg.lr_warmup_steps_ratio * total_steps)
    total = optim_cfg.total_training_steps or total_steps
    kind, floor = optim_cfg.lr_scheduler_type, optim_cfg.min_lr_ratio

    def factor(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        if kind == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


class ValueModel(nn.Module):
    """Critic: the policy's backbone (lm_head dropped) plus a scalar value head."""

    _no_split_modules: list[str] = []

    def __init__(self, path: str, dtype: str = "float32", gradient_checkpointing: bool = False) -> None:
        super().__init__()
        lm = load_causal_lm(path, dtype, gradient_checkpointing)
        self.backbone = lm.get_decoder() if hasattr(lm, "get_decoder") else lm.model
        self._no_split_modules = list(getattr(lm, "_no_split_modules", None) or [])
        self.value_head = nn.Linear(lm.config.hidden_size, 1, dtype=getattr(torch, dtype))
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: Tensor, position_ids: Tensor) -> Tensor:
        """Values [1, L] for a packed row."""
        hidden = self.backbone(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
        return self.value_head(hidden).squeeze(-1).float()
