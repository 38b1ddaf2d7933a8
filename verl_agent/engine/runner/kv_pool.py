"""Slot-indexed KV cache for continuous batching: one fixed row ("slot") of KV memory per sequence.

Memory layout, per layer: K and V of shape [slots, kv_heads, length + 1, head_dim].
A sequence owns one slot; its token at position p has its K/V at column p, so
a session's history stays in place across turns and a later turn only writes
its new columns. Column `length` is scratch: rows that take part in a forward
without a real token (idle slots in a decode step, left padding in a prefill
chunk) write there, and no mask ever shows it.

The pool plugs into an unmodified transformers model as its cache object:
each attention layer calls `update(key, value, layer_idx, ...)`, which writes
the new K/V at the planned (slot, position) pairs and returns the first
`kv_len` columns of the rows in this forward. The attention itself is
`slot_attention`, registered with transformers' `AttentionInterface` and
switched on only while the engine runs the model (`slot_attention_enabled`),
so a model shared with the trainer keeps its own attention setting.

Why our own attention function: transformers' sdpa path expands K/V to every
query head (`repeat_kv`) whenever a mask is given, which multiplies the KV
memory a decode step reads by the GQA group size (7x for Qwen2-0.5B). For one
query token we fold the query heads of a group into the query-length axis
instead, so SDPA reads each K/V head once.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from verl_agent.engine.runner.arena import ALIGN, Arena

ATTN_NAME = "verl_agent_slots"

__all__ = ["ATTN_NAME", "KVBudget", "SlotKVPool", "decode_reserve", "device_available_bytes", "device_memory_bytes",
           "kv_bytes_per_token", "plan_budget", "share_budget", "slot_attention_enabled"]


def slot_attention(module: Any, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """SDPA over the pool's K/V with an explicit additive mask [B, 1, T, kv_len]; returns ([B, T, H, D], None)."""
    b, h, t, d = query.shape
    hkv = key.shape[1]
    key, value = key[:, :, : attention_mask.shape[-1]], value[:, :, : attention_mask.shape[-1]]  # the kv_len columns
    group = h // hkv
    if t == 1 and group > 1:  # decode: query heads of one group become that group's query rows
        q = query.reshape(b, hkv, group, d)
        out = F.scaled_dot_product_attention(q, key, value, attn_mask=attention_mask, scale=scaling)
        return out.reshape(b, h, 1, d).transpose(1, 2), None
    if group > 1:  # prefill chunk: K/V are small next to the T x kv_len mask, so expand them
        key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    with _prefill_backends(query):
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _prefill_backends(query: torch.Tensor) -> contextlib.AbstractContextManager:
    """On CUDA, prefill chunks use the memory-efficient kernel, never cuDNN's.

    cuDNN attention builds an execution plan per new shape, and prefill chunks change shape at
    nearly every call; the memory-efficient kernel needs no plan. Decode steps keep the default
    backend: their shapes are fixed and captured in CUDA graphs."""
    if not query.is_cuda:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, slot_attention)


@contextlib.contextmanager
def slot_attention_enabled(model: Any) -> Iterator[None]:
    """Run `model` with `slot_attention` for the duration of the block (restores the previous setting)."""
    _register()
    cfg = model.config
    prev = cfg._attn_implementation
    cfg._attn_implementation = ATTN_NAME
    try:
        yield
    finally:
        cfg._attn_implementation = prev


def _shape(config: Any) -> tuple[int, int, int]:
    layers = int(config.num_hidden_layers)
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return layers, kv_heads, head_dim


def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    layers, kv_heads, head_dim = _shape(config)
    return 2 * layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class KVBudget:
    """How the KV memory budget was spent: `slots` sequences of at most `length` tokens each."""

    slots: int
    length: int
    budget_bytes: int
    bytes_per_token: int

    def describe(self) -> str:
        return (
            f"{self.slots} slots x {self.length} tokens, "
            f"{self.slots * (self.length + 1) * self.bytes_per_token / 2**20:.0f} MiB of a "
            f"{self.budget_bytes / 2**20:.0f} MiB KV budget"
        )


def device_memory_bytes(device: torch.device) -> int:
    """Total memory of the device the cache lives on (host RAM for CPU, or the cgroup's limit when lower)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    total = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    limit = _cgroup_value("memory.max")
    return min(total, limit) if limit else total


def device_available_bytes(device: torch.device) -> int:
    """Memory that can be allocated now: free device memory on CUDA; on CPU the kernel's MemAvailable (free
    plus reclaimable page cache), within the cgroup's limit when one is set."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    available = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    if available is None:
        available = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"))
    limit, used = _cgroup_value("memory.max"), _cgroup_value("memory.current")
    return min(available, limit - used) if limit and used is not None else available


def _cgroup_value(name: str) -> int | None:
    """A number from this process's cgroup v2 directory (None: no such file, or "max")."""
    try:
        with open("/proc/self/cgroup") as f:
            rel = f.read().strip().split("::")[-1]
        with open(f"/sys/fs/cgroup{rel}/{name}") as f:
            text = f.read().strip()
    except (OSError, IndexError):
        return None
    return int(text) if text.isdigit() else None


def decode_reserve(max_num_seqs: int, vocab: int) -> int:
    """Bytes an engine keeps aside beside weights and KV: activations, float logits and sampling temporaries."""
    return 2**30 + max_num_seqs * vocab * 16


def share_budget(weights: int, vocab: int, max_num_seqs: int, gpu_memory_utilization: float,
                 device: torch.device, sharers: int = 1) -> int:
    """KV bytes from `gpu_memory_utilization`: that share of the device's memory (split between `sharers`
    engines on one host) minus the weights and `decode_reserve`, and never more than is available now
    (on CUDA the free memory, on CPU MemAvailable: other processes and a colocated actor hold memory too)."""
    reserve = decode_reserve(max_num_seqs, vocab)
    budget = int(gpu_memory_utilization * device_memory_bytes(device) / sharers) - weights - reserve
    return min(budget, device_available_bytes(device) // sharers - reserve)


def plan_budget(
    model: Any, max_num_seqs: int, max_len: int, gpu_memory_utilization: float, kv_cache_bytes: int | None = None
) -> KVBudget:
    """Size the pool. The KV budget is `kv_cache_bytes`, or `gpu_memory_utilization` of the device's memory
    minus the weights and a reserve for activations and logits, at most what is available now (`share_budget`).
    Slots get `max_len` tokens each; when fewer than `max_num_seqs` such slots fit, there are fewer
    slots; when not even one fits, one slot holds what the budget allows."""
    param = next(model.parameters())
    bpt = kv_bytes_per_token(model.config, param.dtype)
    if kv_cache_bytes is None:
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        vocab = int(model.get_input_embeddings().weight.shape[0])
        kv_cache_bytes = share_budget(weights, vocab, max_num_seqs, gpu_memory_utilization, param.device)
    tokens = max(0, kv_cache_bytes) // bpt
    if tokens < 2:
        raise ValueError(
            f"HFEngine: no memory left for the KV cache (budget {kv_cache_bytes / 2**20:.0f} MiB after weights): "
            f"raise rollout.gpu_memory_utilization (now {gpu_memory_utilization})"
        )
    slots = min(max_num_seqs, tokens // (max_len + 1))
    if slots >= 1:
        return KVBudget(slots, max_len, kv_cache_bytes, bpt)
    return KVBudget(1, tokens - 1, kv_cache_bytes, bpt)


class SlotKVPool:
    """The KV tensors plus the per-forward plan that tells `update` where this forward's tokens go.

    Set the plan with `plan(write_pos, kv_len, rows)` before each forward:
    `rows` are the slots of the batch rows (None: rows 0..B-1, the decode
    layout, which returns views without copying), `write_pos[b, t]` the column
    for token t of row b (`scratch` for padding), `kv_len` how many columns
    attention sees.
    """

    is_compileable = False

    def __init__(self, config: Any, slots: int, length: int, dtype: torch.dtype, device: torch.device,
                 arena: Arena | None = None) -> None:  # fmt: skip
        layers, kv_heads, head_dim = _shape(config)
        self.slots, self.length, self.scratch = slots, length, length
        shape = (slots, kv_heads, length + 1, head_dim)
        # Columns are zeroed on first use (`plan`), so host RAM is committed only as far as sequences reach;
        # attention reads masked columns too, and uninitialised memory could hold NaN, which masks keep.
        # In an `arena` (see arena.py) the tensors keep their addresses across release and commit.
        new = (lambda: arena.carve(shape, dtype)) if arena is not None else (
            lambda: torch.empty(shape, dtype=dtype, device=device))
        self.k = [new() for _ in range(layers)]
        self.v = [new() for _ in range(layers)]
        self.arena = arena
        self._clean = 0  # columns [0, _clean) of every slot hold zeros or written K/V
        self.row_ids = torch.arange(slots, device=device)  # rows 0..B-1 of a decode step
        self.rows: torch.Tensor | None = None
        self.write_pos: torch.Tensor | None = None
        self.kv_len = length

    @staticmethod
    def arena_bytes(config: Any, slots: int, length: int, dtype: torch.dtype) -> int:
        """Bytes an `Arena` needs to hold a pool of this size."""
        layers, kv_heads, head_dim = _shape(config)
        one = slots * kv_heads * (length + 1) * head_dim * torch.empty((), dtype=dtype).element_size()
        return 2 * layers * -(-one // ALIGN) * ALIGN

    def release(self) -> None:
        """Give the arena's memory back (the tensors keep their addresses; `commit` before the next use)."""
        assert self.arena is not None
        self.arena.release()

    def commit(self) -> None:
        """Memory back under the tensors; its contents are gone, so every column is zeroed again on use."""
        if self.arena is not None and not self.arena.committed:
            self.arena.commit()
            self._clean = 0

    def plan(self, write_pos: torch.Tensor, kv_len: int, rows: torch.Tensor | None = None) -> None:
        assert kv_len <= self._clean, f"call ensure_clean({kv_len}) before the forward (outside graph capture)"
        self.write_pos, self.kv_len, self.rows = write_pos, kv_len, rows

    def ensure_clean(self, kv_len: int) -> None:
        """Zero the columns [.., kv_len) never used so far, in every slot."""
        if kv_len > self._clean:
            for t in (*self.k, *self.v):
                t[:, :, self._clean : kv_len].zero_()
            self._clean = kv_len

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        """transformers' cache hook: store this forward's K/V [B, H, T, D], return the visible K/V."""
        k_all, v_all = self.k[layer_idx], self.v[layer_idx]
        b, _, t, _ = key.shape
        rows = self.row_ids[:b] if self.rows is None else self.rows
        idx = rows[:, None].expand(b, t)
        k_all[idx, :, self.write_pos] = key.transpose(1, 2).to(k_all.dtype)
        v_all[idx, :, self.write_pos] = value.transpose(1, 2).to(v_all.dtype)
        if self.rows is None:  # decode: views; attention keeps the mask's kv_len columns (so that a compiled
            return k_all[:b], v_all[:b]  # step takes kv_len from a tensor's shape and need not recompile for it)
        return k_all[self.rows, :, : self.kv_len], v_all[self.rows, :, : self.kv_len]

    def swap(self, pairs: list[tuple[int, int]]) -> None:
        """Exchange the K/V of slot pairs (a, b), all layers."""
        src = torch.tensor([i for a, b in pairs for i in (a, b)], device=self.row_ids.device)
        dst = torch.tensor([i for a, b in pairs for i in (b, a)], device=self.row_ids.device)
        for t in (*self.k, *self.v):
            t[dst] = t[src]

    def copy_prefix(self, copies: list[tuple[int, int, int]]) -> None:
        """Copy the first n columns of K/V from one slot into another, all layers, for each (from, to, n): a
        prompt's K/V shared with a request of the same prompt. Columns up to the largest n are copied for
        every pair; those past a pair's own n are harmless, as a forward writes a column before its mask
        shows it."""
        n = max(c for _, _, c in copies)
        src = torch.tensor([a for a, _, _ in copies], device=self.row_ids.device)
        dst = torch.tensor([b for _, b, _ in copies], device=self.row_ids.device)
        for t in (*self.k, *self.v):
            t[dst, :, :n] = t[src, :, :n]

    # Answers for transformers code that asks a cache about itself (unused with explicit positions and masks).
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def __len__(self) -> int:
        return len(self.k)
