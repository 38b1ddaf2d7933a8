"""LoRA adapters in the hf engine: the trainer sends only adapter tensors, the engine applies them.

Names: ``<linear module>.lora_A.weight`` [r, in] and ``<linear module>.lora_B.weight`` [out, r], with B
already multiplied by the adapter's scaling (lora_alpha / r), so the policy's linear layer is
``W x + B (A x)``. Two ways to apply them (``HFEngineSettings.lora_mode``):

- ``merge``: ``W = W0 + B A`` written into the engine's own weight; the first merge keeps a copy of each
  targeted base weight ``W0`` (a non-persistent buffer, so it follows the model between devices) and every
  later merge starts from it again, so many syncs never drift and the decode step costs what it did.
- ``unmerged``: the layer keeps ``W0`` and computes ``W0 x + B (A x)`` in every forward (two thin matmuls
  more per layer, no copy of the base weights); A and B are buffers updated in place, so captured CUDA
  graphs keep reading the current adapter.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from verl_agent.engine.settings import LORA_MODES

__all__ = ["LORA_MODES", "LoRALinear", "apply_adapters", "is_adapter_name", "split_adapter_tensors"]

_SUFFIXES = (".lora_A.weight", ".lora_B.weight")


def is_adapter_name(name: str) -> bool:
    return name.endswith(_SUFFIXES)


def split_adapter_tensors(named: Iterable[tuple[str, Tensor]]
                          ) -> tuple[list[tuple[str, Tensor]], dict[str, dict[str, Tensor]]]:  # fmt: skip
    """(plain parameters, {module name: {"A": tensor, "B": tensor}}) of one update."""
    plain, adapters = [], {}
    for name, tensor in named:
        if is_adapter_name(name):
            module, kind = name.rsplit(".", 2)[0], name.rsplit(".", 2)[1][-1]
            adapters.setdefault(module, {})[kind] = tensor
        else:
            plain.append((name, tensor))
    return plain, adapters


class LoRALinear(nn.Linear):
    """A linear layer that adds ``B (A x)`` (buffers ``lora_A``, ``lora_B``) to its output: the unmerged mode.

    Installed by swapping the class of an existing `nn.Linear` (same object, parameters and names)."""

    lora_A: Tensor
    lora_B: Tensor

    def forward(self, x: Tensor) -> Tensor:
        y = super().forward(x)
        xa = nn.functional.linear(x, self.lora_A)
        # B (A x) accumulated into the base output by the GEMM itself: no third kernel, one rounding
        y.view(-1, y.shape[-1]).addmm_(xa.reshape(-1, xa.shape[-1]), self.lora_B.t())
        return y


def _linear(model: nn.Module, name: str) -> nn.Linear:
    try:
        module = model.get_submodule(name)
    except AttributeError:
        raise KeyError(f"HFEngine.update_weights: adapter for {name!r}, which the model does not have") from None
    if not isinstance(module, nn.Linear):
        raise TypeError(f"HFEngine.update_weights: adapter for {name!r}, a {type(module).__name__}: only linear "
                        "layers take adapters")
    return module


def _check(name: str, module: nn.Linear, pair: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    if set(pair) != {"A", "B"}:
        raise ValueError(f"HFEngine.update_weights: adapter of {name!r} needs lora_A and lora_B in the same "
                         f"update, got only lora_{''.join(pair)}")
    a, b = pair["A"], pair["B"]
    out_f, in_f = module.weight.shape
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_f or b.shape[0] != out_f or a.shape[0] != b.shape[1]:
        raise ValueError(f"HFEngine.update_weights: adapter of {name!r} has lora_A {tuple(a.shape)} and lora_B "
                         f"{tuple(b.shape)}; the layer is {in_f} -> {out_f}")
    return a, b


@torch.no_grad()
def _merge(module: nn.Linear, a: Tensor, b: Tensor) -> None:
    w = module.weight
    base = getattr(module, "lora_base", None)
    if base is None:
        base = w.detach().clone()
        module.register_buffer("lora_base", base, persistent=False)
    a32, b32 = a.to(w.device, torch.float32), b.to(w.device, torch.float32)
    if w.dtype == torch.float32:  # one fused W0 + B A straight into the weight, no temporaries
        torch.addmm(base, b32, a32, out=w.data)
    else:  # in fp32, rounded once to the weight's dtype
        w.copy_(torch.addmm(base.float(), b32, a32))


@torch.no_grad()
def _set_unmerged(module: nn.Linear, a: Tensor, b: Tensor) -> bool:
    w = module.weight
    new = not isinstance(module, LoRALinear) or module.lora_A.shape != a.shape
    if new:
        module.register_buffer("lora_A", torch.empty(a.shape, dtype=w.dtype, device=w.device), persistent=False)
        module.register_buffer("lora_B", torch.empty(b.shape, dtype=w.dtype, device=w.device), persistent=False)
        module.__class__ = LoRALinear
    module.lora_A.copy_(a)
    module.lora_B.copy_(b)
    return new


def apply_adapters(model: nn.Module, adapters: dict[str, dict[str, Tensor]], mode: str) -> int:
    """Apply every adapter of one update to `model` as `mode` says; returns how many layers got new adapter
    buffers (unmerged: the forward changed, so captured CUDA graphs are stale).

    Raises (before changing anything) on an unknown or non-linear layer, a missing half or mismatched shapes.
    A layer changes its mode only by a new engine: it starts in one mode and stays in it."""
    if mode not in LORA_MODES:
        raise ValueError(f"lora_mode must be one of {LORA_MODES}, got {mode!r}")
    checked = [(_linear(model, name), *_check(name, _linear(model, name), pair)) for name, pair in adapters.items()]
    installed = 0
    for module, a, b in checked:
        if mode == "merge":
            _merge(module, a, b)
        else:
            installed += _set_unmerged(module, a, b)
    return installed
