"""The engine's RMSNorm layers through torch's fused RMSNorm (`F.rms_norm`: one kernel on CUDA for the
statistics and the scaling, where the models' own forward launches one per step: cast, square, mean, add,
rsqrt, multiply). A decode step has two norms a layer over a few rows, so these small kernels cost more in
launches than in work.

The engine switches the layers only while it runs the model (`FusedNorms.active`, like the slot attention);
the trainer switches its own model's layers for good (`fuse_norms`): autograd goes through the fused kernel's
backward too, and the log-probs it differentiates come from the forward the engine samples with.
The model's rounding points stay where they were: normalise in fp32, round to the input dtype, then multiply
by the weight in that dtype, so the engine samples from the forward the trainer differentiates. A layer is
switched only where its own forward gives the same output on its own weight (checked once per layer when
the engine loads); other norm variants (a ``1 + weight`` scale, a norm without an ``eps`` attribute) keep
their forward.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["FusedNorms", "fuse_norms"]

_FUSED: dict[type, type] = {}


def _fused_forward(self: nn.Module, hidden_states: Tensor) -> Tensor:
    normed = F.rms_norm(hidden_states.float(), (hidden_states.shape[-1],), eps=self.variance_epsilon)
    return self.weight * normed.to(hidden_states.dtype)


def _fused_class(cls: type) -> type:
    """A subclass per original class (isinstance checks and the class name's prefix keep working)."""
    if cls not in _FUSED:
        _FUSED[cls] = type(f"Fused{cls.__name__}", (cls,), {"forward": _fused_forward, "__module__": __name__})
    return _FUSED[cls]


def _candidate(module: nn.Module) -> bool:
    w = getattr(module, "weight", None)
    return (type(module).__name__.endswith("RMSNorm") and type(module) not in _FUSED.values()
            and isinstance(w, nn.Parameter) and w.dim() == 1 and w.is_floating_point()
            and isinstance(getattr(module, "variance_epsilon", None), float))  # fmt: skip


@torch.no_grad()
def _same_output(module: nn.Module) -> bool:
    """The layer's own forward and the fused one agree on a random input in the weight's dtype and device."""
    w = module.weight
    x = torch.randn(4, w.shape[0], generator=torch.Generator().manual_seed(0)).to(device=w.device, dtype=w.dtype)
    ours, theirs = _fused_forward(module, x), type(module).forward(module, x)
    if ours.shape != theirs.shape or ours.dtype != theirs.dtype:
        return False
    # CPU: the same arithmetic; CUDA: the fused kernel reduces in another order (one rounding of the dtype)
    tol = torch.finfo(w.dtype).eps * 4
    return torch.allclose(ours.float(), theirs.float(), rtol=tol, atol=tol)


class FusedNorms:
    """The RMSNorm layers of one model that the fused forward reproduces, switched (by class) only inside
    `active()`: the engine runs the model with them, and the model is unchanged for everyone else."""

    def __init__(self, model: nn.Module) -> None:
        self.layers = [(m, type(m), _fused_class(type(m))) for m in model.modules()
                       if _candidate(m) and m.weight.numel() and _same_output(m)]  # fmt: skip

    def __len__(self) -> int:
        return len(self.layers)

    @contextmanager
    def active(self) -> Iterator[None]:
        for module, _, fused in self.layers:
            module.__class__ = fused
        try:
            yield
        finally:
            for module, own, _ in self.layers:
                module.__class__ = own


def fuse_norms(model: nn.Module) -> int:
    """Switch the model's RMSNorm layers to the fused forward for good (the trainer's copy); how many."""
    layers = FusedNorms(model).layers
    for module, _, fused in layers:
        module.__class__ = fused
    return len(layers)
