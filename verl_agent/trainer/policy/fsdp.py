"""Model building blocks of a worker: load, shard with FSDP2, gather for the engine, LR schedule, critic.

FSDP2 (`fully_shard`) is applied to every decoder layer and then to the root,
so one layer's full parameters exist at a time during forward/backward. A single
rank whose parameters are already in the compute dtype stays a plain module:
there FSDP2 would shard nothing and only add copies. On
GPU, parameters stay fp32 (the optimizer's master copy) and compute runs in
bf16 through `MixedPrecisionPolicy`; on CPU everything is fp32 (FSDP2's
CPU offload needs an accelerator, so it is not offered on CPU).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import Tensor, nn

from verl_agent.rollout.build import resolve_model_path

__all__ = ["load_causal_lm", "shard", "iter_full_param_buckets", "make_scheduler", "ValueModel"]




def load_causal_lm(path: str, dtype: str = "float32", gradient_checkpointing: bool = False,
                   trust_remote_code: bool = False) -> nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(path), dtype=getattr(torch, dtype),
                                                 trust_remote_code=trust_remote_code)
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


def shard(model: nn.Module, mesh, device_type: str, reshard_after_forward: bool = True, offload: bool = False
          ) -> nn.Module:  # fmt: skip
    """fully_shard each decoder layer, then the root; bf16 compute with fp32 master weights on GPU.

    offload (fsdp_config.param_offload, GPU only): FSDP2's CPUOffloadPolicy keeps the sharded
    parameters, their gradients and the optimizer state in pinned host memory; each layer is
    copied to the GPU for its forward/backward and the optimizer steps on the CPU.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs: dict = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    if offload:
        if device_type != "cuda":
            raise ValueError("fsdp_config.param_offload needs GPU workers (FSDP2 CPU offload fails on CPU)")
        kwargs["offload_policy"] = CPUOffloadPolicy()
    # LoRA: a frozen bf16 base beside fp32 adapters (FSDP2 wants one dtype among the trained parameters only)
    if device_type == "cuda" and any(p.dtype == torch.float32 for p in model.parameters()):
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if mesh.size() == 1 and not offload and "mp_policy" not in kwargs:
        # One rank computing in its parameters' own dtype: FSDP2 would gather nothing, only copy every layer's
        # weights in and its gradients out on each micro-batch. The plain module computes the same.
        return model
    for layer in _decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def iter_full_param_buckets(model: nn.Module, bucket_bytes: int = 64 << 20, dtype: torch.dtype | None = None,
                            params: list[tuple[str, Tensor]] | None = None) -> Iterator[list[tuple[str, Tensor]]]:
    """Full (unsharded) parameters on the model's device, bucket by bucket, optionally cast to ``dtype``.

    Collective: every rank must iterate to the end. Each bucket is ONE all-gather of a flat buffer
    holding this rank's shards of several parameters (cast to ``dtype`` first, so a bf16 engine
    moves half the bytes of fp32 master weights); nothing goes through host memory. With one rank
    the local tensors are the full ones and come back as they are, in a single bucket (no copy;
    a cast to ``dtype`` goes bucket by bucket). The tensors of a bucket are valid until the next bucket is
    requested: consume (copy) them before advancing. ``params``: these (name, parameter) of the model only
    (LoRA: the adapters), in this order, instead of all of them.
    """
    params = [(n, p.detach()) for n, p in (model.named_parameters() if params is None else params)]
    sharded = any(hasattr(p, "full_tensor") for _, p in params)
    mesh = _shard0_mesh([p for _, p in params]) if sharded else None
    if not sharded or (mesh is not None and mesh.size() == 1):
        local = [(n, p.to_local() if hasattr(p, "to_local") else p) for n, p in params]
        if dtype is None or all(t.dtype == dtype for _, t in local):
            yield local  # views of the parameters themselves: one bucket costs no memory
            return
        params, mesh = local, None  # casts: bucket by bucket like the gathers below
    bucket, size = [], 0
    for i, (name, p) in enumerate(params):
        bucket.append((name, p))
        size += p.numel() * (dtype or p.dtype).itemsize
        if size >= bucket_bytes or i == len(params) - 1:
            if mesh is not None:
                yield _gather_flat(bucket, mesh, dtype)
            else:  # other placements: DTensor gathers each parameter itself
                yield [(n, _full(t, dtype)) for n, t in bucket]
            bucket, size = [], 0


def _full(p: Tensor, dtype: torch.dtype | None) -> Tensor:
    full = p.full_tensor() if hasattr(p, "full_tensor") else p
    return full if dtype is None else full.to(dtype)


def _shard0_mesh(params: list[Tensor]):
    """The common 1-D mesh when every parameter is a DTensor sharded on dim 0 (FSDP2), else None."""
    from torch.distributed.tensor import DTensor, Shard

    meshes = {id(p.device_mesh): p.device_mesh for p in params if isinstance(p, DTensor)}
    if len(meshes) != 1 or not all(isinstance(p, DTensor) and p.device_mesh.ndim == 1
                                   and tuple(p.placements) == (Shard(0),) for p in params):
        return None
    return next(iter(meshes.values()))


def _gather_flat(bucket: list[tuple[str, Tensor]], mesh, dtype: torch.dtype | None) -> list[tuple[str, Tensor]]:
    """All-gather the Shard(0) DTensors of a bucket through one flat buffer (torch.chunk layout, padded)."""
    import torch.distributed as dist

    world = mesh.size()
    out_dtype = dtype or bucket[0][1].dtype
    if any((dtype or p.dtype) != out_dtype for _, p in bucket):  # mixed dtypes: no flat buffer
        return [(n, _full(p, dtype)) for n, p in bucket]
    layout, total = [], 0  # per param: offset in a rank's segment, rows per rank, elements per row
    for _, p in bucket:
        rows = -(-p.shape[0] // world)
        per_row = math.prod(p.shape[1:])  # not p[0].numel(): indexing a DTensor gathers all of it
        layout.append((total, rows, per_row))
        total += rows * per_row
    local0 = bucket[0][1].to_local()
    send = torch.empty(total, dtype=out_dtype, device=local0.device)
    for (_, p), (off, _, _) in zip(bucket, layout):
        loc = p.to_local().reshape(-1)
        send[off:off + loc.numel()].copy_(loc)
    recv = torch.empty(world * total, dtype=out_dtype, device=send.device)
    dist.all_gather_into_tensor(recv, send, group=mesh.get_group())
    recv = recv.view(world, total)
    full = []
    for (name, p), (off, rows, per_row) in zip(bucket, layout):
        parts = [recv[r, off:off + max(0, min(rows, p.shape[0] - r * rows)) * per_row] for r in range(world)]
        full.append((name, torch.cat(parts).view(p.shape)))
    return full


def make_scheduler(optimizer: torch.optim.Optimizer, optim_cfg, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warmup (lr_warmup_steps; 0 or verl's -1: lr_warmup_steps_ratio of total) then constant or cosine
    to min_lr_ratio."""
    steps = optim_cfg.lr_warmup_steps
    warmup = steps if steps > 0 else int(optim_cfg.lr_warmup_steps_ratio * total_steps)
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

    def forward(self, input_ids: Tensor, position_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                ) -> Tensor:
        """Values [B, L] (a packed row with position_ids, or a padded batch with attention_mask)."""
        hidden = self.backbone(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                               use_cache=False).last_hidden_state
        return self.value_head(hidden).squeeze(-1).float()
