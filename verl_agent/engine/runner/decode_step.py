"""The engine's own decode step for Llama-family decoders (Llama, Mistral, Qwen2, Qwen3).

transformers' forward is written for a whole model: compiled, dynamo traces every decoder layer again
(each is a module of its own, its `layer_idx` picks its cache), so the compile time grows with the depth.
Here one decoder layer is a function of tensors only: its weights, its K/V tensors, the rows' rotary
factors, write columns and mask. Every layer has the same shapes, so one trace and one compiled graph
serve them all, and a compile (cold or from the cache) costs about one layer's.

The arithmetic is the model's own, op for op (rounding points included): RMSNorm in fp32 rounded to the
input dtype and then scaled (`F.rms_norm` where the engine fuses the norms, see fused_norms.py), rotary
factors from the model's own rotary module, SDPA over the slot pool with a group's query heads folded
into the query axis (kv_pool.slot_attention's decode path), SiLU-gated MLP, residual adds in the model's
order. Each layer's residual add is done by the next layer (and the final norm), so it joins that layer's
first kernel.

Projections that read one input (q/k/v, and gate/up) run as one product when their weights lie back to
back in memory (`HFEngine` lays its own weights out that way, see arena.ParamArena, and so does the trainer
for an actor whose tensors the engine borrows, `place_back_to_back`): one wide GEMM instead of three
narrow ones, and the K/V heads' thin products stop wasting most of the GPU.

A model qualifies when its type is one of `MODEL_TYPES` and every layer has the plain modules this code
reproduces (`DecodeStep.of` returns None otherwise, and the engine runs transformers' forward).
Unmerged LoRA adapters (lora.LoRALinear) are read with the weights at every call: each adapted projection
adds ``B (A x)`` to its slice of the (fused) product, as LoRALinear does, one accumulating product. A
projection of any other class (`applies` checks at each call) sends the step back to transformers' forward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from verl_agent.engine.runner.lora import LoRALinear

__all__ = ["MODEL_TYPES", "DecodeStep", "fusion_groups", "place_back_to_back"]

MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
_ATTN, _MLP = ("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")

# One layer's tensors, in this order (None where a model has no such tensor):
# ln1, (q, k, v) or (qkv,), their biases (same arity), o, o bias, q_norm, k_norm, ln2, (gate, up) or (gate_up,), down,
# and the unmerged adapters of q, k, v, o, gate, up, down: (A, B) each, or None
LayerTensors = tuple[Any, ...]
Adapter = tuple[Tensor, Tensor] | None


def fusion_groups(model: nn.Module) -> list[list[nn.Parameter]]:
    """The parameters that a fused product reads as one tensor: each layer's q/k/v weights, their biases,
    and gate/up weights. An arena that lays each group out back to back lets `DecodeStep` fuse them."""
    groups = []
    for layer in _layers(model) or []:
        attn, mlp = layer.self_attn, layer.mlp
        for owner, names, what in ((attn, _ATTN, "weight"), (attn, _ATTN, "bias"), (mlp, _MLP, "weight")):
            params = [getattr(getattr(owner, n, None), what, None) for n in names]
            if all(isinstance(p, nn.Parameter) for p in params):
                groups.append(params)
    return groups


@torch.no_grad()
def place_back_to_back(model: nn.Module) -> int:
    """Move each of `fusion_groups(model)` into one new allocation of its own, back to back (the values
    stay; an optimizer built afterwards updates the views): for a model whose tensors an engine borrows
    (trainer/weights/shared_weights.py). Returns how many groups moved."""
    groups = [g for g in fusion_groups(model) if len({(p.dtype, p.device) for p in g}) == 1]
    for g in groups:
        flat = torch.empty(sum(p.numel() for p in g), dtype=g[0].dtype, device=g[0].device)
        at = 0
        for p in g:
            view = flat[at : at + p.numel()].view(p.shape)
            view.copy_(p.data)
            p.data = view
            at += p.numel()
    if any(g[0].is_cuda for g in groups):  # the old tensors' memory back to the device, for memory planners
        torch.cuda.empty_cache()
    return len(groups)


def _layers(model: nn.Module) -> Sequence[nn.Module] | None:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    return layers if isinstance(layers, nn.ModuleList) else None


def _norm_ok(m: Any) -> bool:
    w = getattr(m, "weight", None)
    return (type(m).__name__.endswith("RMSNorm") and isinstance(w, nn.Parameter) and w.dim() == 1
            and isinstance(getattr(m, "variance_epsilon", None), float))  # fmt: skip


def _linear_or_adapted(m: Any) -> bool:
    return type(m) in (nn.Linear, LoRALinear)


def _adapter(m: nn.Linear) -> Adapter:
    return (m.lora_A, m.lora_B) if type(m) is LoRALinear else None


def _adapted(y: Tensor, x: Tensor, adapter: Adapter) -> Tensor:
    """`y` plus an unmerged adapter's ``B (A x)``, accumulated by the product itself (as LoRALinear does)."""
    if adapter is None:
        return y
    a, b = adapter
    return torch.addmm(y, F.linear(x, a), b.t())


def _back_to_back(tensors: Sequence[Tensor | None]) -> Tensor | None:
    """One view over `tensors` when they are contiguous and consecutive in one storage (else None)."""
    if any(t is None for t in tensors):
        return None
    first = tensors[0]
    offset, rows = first.storage_offset(), 0
    for t in tensors:
        if (not t.is_contiguous() or t.dtype != first.dtype or t.device != first.device
                or t.shape[1:] != first.shape[1:] or t.storage_offset() != offset
                or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()):  # fmt: skip
            return None
        offset += t.numel()
        rows += t.shape[0]
    return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


def _group(mods: Sequence[nn.Linear], fuse: bool) -> tuple[tuple[Tensor, ...], tuple[Tensor | None, ...]]:
    weights = [m.weight for m in mods]
    biases = [m.bias for m in mods]
    if fuse:
        w = _back_to_back(weights)
        if w is not None:
            if all(b is None for b in biases):
                return (w,), (None,)
            b = _back_to_back(biases)
            if b is not None:
                return (w,), (b,)
    return tuple(weights), tuple(biases)


class DecodeStep:
    """The decode forward of one model over the slot pool (`__call__`), built from the model's modules.

    `layer` is the per-layer function; the engine may compile it (`compiled_layer`). `__call__` reads the
    model's current parameters at every call, so sleep, wake and weight loads need nothing from here."""

    def __init__(self, model: nn.Module, fused_norms: bool, fuse_projections: bool = True) -> None:
        cfg = model.config
        self.model, self.fuse = model, fuse_projections
        self.heads = int(cfg.num_attention_heads)
        self.kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.heads)
        layers = _layers(model)
        assert layers is not None
        self.layers = list(layers)
        self.eps = float(self.layers[0].input_layernorm.variance_epsilon)
        self.scaling = float(getattr(self.layers[0].self_attn, "scaling", self.head_dim**-0.5))
        self.qk_norm = hasattr(self.layers[0].self_attn, "q_norm")
        self.rms = _fused_rms if fused_norms else _model_rms
        self.layer: Callable[..., tuple[Tensor, Tensor]] = self._layer
        self.compiled_layer: Callable[..., tuple[Tensor, Tensor]] | None = None

    @classmethod
    def of(cls, model: nn.Module, fused_norms: bool, fuse_projections: bool = True) -> DecodeStep | None:
        """A decode step for `model`, or None when this code does not reproduce its forward."""
        cfg = getattr(model, "config", None)
        layers = _layers(model)
        if cfg is None or getattr(cfg, "model_type", None) not in MODEL_TYPES or not layers:
            return None
        if getattr(cfg, "hidden_act", None) not in ("silu", "swish") or getattr(cfg, "mlp_bias", False):
            return None
        inner = model.model
        parts_ok = (isinstance(getattr(inner, "embed_tokens", None), nn.Embedding) and hasattr(inner, "rotary_emb")
                    and _norm_ok(getattr(inner, "norm", None)) and isinstance(getattr(model, "lm_head", None), nn.Linear))
        if not parts_ok:
            return None
        eps = {float(inner.norm.variance_epsilon)}
        for layer in layers:
            attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            norms = [getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None)]
            if hasattr(attn, "q_norm"):
                norms += [attn.q_norm, getattr(attn, "k_norm", None)]
            if attn is None or mlp is None or not all(_norm_ok(n) for n in norms):
                return None
            if getattr(attn, "sliding_window", None) is not None:  # the engine refuses short windows anyway
                return None
            if not all(isinstance(getattr(attn, n, None), nn.Linear) for n in (*_ATTN, "o_proj")):
                return None
            if not all(isinstance(getattr(mlp, n, None), nn.Linear) for n in (*_MLP, "down_proj")):
                return None
            eps |= {float(n.variance_epsilon) for n in norms}
        if len(eps) != 1:  # one eps for every norm: the compiled layer bakes it in
            return None
        return cls(model, fused_norms, fuse_projections)

    def applies(self) -> bool:
        """Every projection is still a linear layer, plain or with an unmerged adapter (the engine's unmerged
        LoRA swaps their class, and so might other code)."""
        for layer in self.layers:
            if not all(_linear_or_adapted(x) for x in _projections(layer)):
                return False
        return _linear_or_adapted(self.model.lm_head)

    def tensors(self, layer: nn.Module) -> LayerTensors:
        a, m = layer.self_attn, layer.mlp
        qkv_w, qkv_b = _group((a.q_proj, a.k_proj, a.v_proj), self.fuse)
        gu_w, _ = _group((m.gate_proj, m.up_proj), self.fuse)
        qn = a.q_norm.weight if self.qk_norm else None
        kn = a.k_norm.weight if self.qk_norm else None
        adapters = tuple(_adapter(x) for x in _projections(layer))
        return (layer.input_layernorm.weight, qkv_w, qkv_b, a.o_proj.weight, a.o_proj.bias, qn, kn,
                layer.post_attention_layernorm.weight, gu_w, m.down_proj.weight, adapters)  # fmt: skip

    # -- the forward ---------------------------------------------------------------------------------
    @torch.no_grad()  # the weights require grad (a borrowed actor's); a traced step must not record for autograd
    def __call__(self, ids: Tensor, positions: Tensor, write: Tensor, mask: Tensor, k_cache: Sequence[Tensor],
                 v_cache: Sequence[Tensor], rows: Tensor) -> Tensor:  # fmt: skip
        """Logits [R, V] for one token in each of rows 0..R-1: `ids`, `positions`, `write` (its K/V column) [R],
        `mask` [R, 1, 1, kv_len] additive; each layer's K/V is written into `k_cache[i]` / `v_cache[i]`."""
        inner = self.model.model
        h = inner.embed_tokens(ids)
        cos, sin = inner.rotary_emb(h[:, None], positions[:, None])  # [R, 1, D] in the hidden dtype
        delta = torch.zeros_like(h)
        layer = self.compiled_layer or self.layer
        for i, mod in enumerate(self.layers):
            h, delta = layer(h, delta, self.tensors(mod), k_cache[i], v_cache[i], cos, sin, rows, write, mask)
        out = self.rms(h + delta, inner.norm.weight, self.eps)
        head = self.model.lm_head
        return _adapted(F.linear(out, head.weight, head.bias), out, _adapter(head))

    def _layer(self, h: Tensor, delta: Tensor, w: LayerTensors, k_cache: Tensor, v_cache: Tensor, cos: Tensor,
               sin: Tensor, rows: Tensor, write: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:  # fmt: skip
        """One decoder layer: returns (the residual stream before this layer's MLP is added, the MLP's output)."""
        ln1, qkv_w, qkv_b, o_w, o_b, q_norm, k_norm, ln2, gu_w, down_w, (q_ad, k_ad, v_ad, o_ad, g_ad, u_ad, d_ad) = w
        r, n_h, n_kv, d = h.shape[0], self.heads, self.kv_heads, self.head_dim
        h = h + delta
        x = self.rms(h, ln1, self.eps)
        if len(qkv_w) == 1:
            q, k, v = F.linear(x, qkv_w[0], qkv_b[0]).split((n_h * d, n_kv * d, n_kv * d), dim=-1)
        else:
            q, k, v = (F.linear(x, wt, b) for wt, b in zip(qkv_w, qkv_b))
        q, k, v = _adapted(q, x, q_ad), _adapted(k, x, k_ad), _adapted(v, x, v_ad)
        q, k, v = q.reshape(r, n_h, d), k.reshape(r, n_kv, d), v.reshape(r, n_kv, d)
        if q_norm is not None:
            q, k = self.rms(q, q_norm, self.eps), self.rms(k, k_norm, self.eps)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k_cache[rows, :, write] = k.to(k_cache.dtype)
        v_cache[rows, :, write] = v.to(v_cache.dtype)
        kv_len = mask.shape[-1]
        keys, values = k_cache[:r, :, :kv_len], v_cache[:r, :, :kv_len]
        # the query heads of a group become that group's query rows: each K/V head is read once
        att = F.scaled_dot_product_attention(q.view(r, n_kv, n_h // n_kv, d), keys, values, attn_mask=mask,
                                             scale=self.scaling)  # fmt: skip
        att = att.reshape(r, n_h * d)
        h = h + _adapted(F.linear(att, o_w, o_b), att, o_ad)
        x = self.rms(h, ln2, self.eps)
        if len(gu_w) == 1:
            gate, up = F.linear(x, gu_w[0]).chunk(2, dim=-1)
        else:
            gate, up = F.linear(x, gu_w[0]), F.linear(x, gu_w[1])
        act = F.silu(_adapted(gate, x, g_ad)) * _adapted(up, x, u_ad)
        return h, _adapted(F.linear(act, down_w), act, d_ad)


def _projections(layer: nn.Module) -> tuple[nn.Module, ...]:
    a, m = layer.self_attn, layer.mlp
    return a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _fused_rms(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def _model_rms(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
