"""One batch of requests through a Hugging Face causal LM: left-padded prefill, then step-wise decoding.

Two cache strategies share the same loop:

- dynamic (default, CPU): a `DynamicCache` that grows each step; eager forward.
- static (GPU fast path, see shared/GPU.md): a `StaticCache` of fixed shape
  [batch bucket, heads, length bucket, dim] and a `torch.compile`d decode step
  (CUDA graphs via mode "reduce-overhead"). Shapes never change during decoding:
  the 2-D padding mask covers the whole cache length from the start (causality
  hides the future positions), and batch/length are rounded up to buckets so
  that a few compiled graphs serve all batches.

Finished rows leave a dynamic batch once a quarter of it has finished (the cache
rows are dropped); in a static batch they keep running and their tokens are discarded;
the batch ends when every row has finished.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from verl_agent.engine.contract import GenerateOutput, SamplingParams
from verl_agent.engine.sampling import RowParams, sample

logger = logging.getLogger(__name__)


@dataclass
class DecodeSettings:
    pad_token_id: int
    eos_token_ids: list[int]  # added to every request's stop ids when stop_on_eos
    stop_on_eos: bool = True
    static: bool = False  # static KV cache, fixed shapes
    compile: bool = False  # torch.compile the decode step (CUDA graphs); needs static
    length_bucket: int = 128
    sync_every: int = 1  # check "all finished" every k steps (each check is a device sync)
    max_length: int | None = None  # model context limit


@dataclass
class StaticState:
    """Static caches and the compiled decode call, kept across batches (reused shapes => no recompiles)."""

    caches: dict[tuple[int, int], Any] = field(default_factory=dict)
    compiled: Any = None


def _bucket(n: int, step: int) -> int:
    return -(-n // step) * step


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _accepts(model: Any, name: str) -> bool:
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int, width: int, device: torch.device):
    """Left-pad prompts to `width`; returns (ids [B, width], mask [B, width], lengths [B])."""
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    return ids.to(device), mask.to(device), lengths.to(device)


def _stop_table(params: Sequence[SamplingParams], s: DecodeSettings, device: torch.device) -> torch.Tensor:
    extra = s.eos_token_ids if s.stop_on_eos else []
    rows = [sorted(set(p.stop_token_ids) | set(extra)) or [-1] for p in params]
    width = max(len(r) for r in rows)
    return torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.long, device=device)


def decode_batch(
    model: Any,
    prompts: Sequence[Sequence[int]],
    params: Sequence[SamplingParams],
    s: DecodeSettings,
    state: StaticState,
    generator: torch.Generator | None,
) -> list[GenerateOutput]:
    """Run one batch to completion; outputs are in the order of `prompts`."""
    device = next(model.parameters()).device
    real = len(prompts)
    prompts, params = list(prompts), list(params)
    width = max(len(p) for p in prompts)
    limits = [p.max_new_tokens for p in params]
    if s.max_length is not None:
        limits = [max(1, min(n, s.max_length - len(p))) for n, p in zip(limits, prompts)]
    max_new = max(limits)
    if s.static:  # pad the batch with 1-token dummy rows up to a power-of-two bucket
        extra = _pow2(real) - real
        prompts += [[s.pad_token_id]] * extra
        params += [SamplingParams(temperature=0.0, max_new_tokens=1)] * extra
        limits += [1] * extra
    ids, mask, lengths = left_pad(prompts, s.pad_token_id, width, device)
    rows = RowParams.build(params, device)
    stops = _stop_table(params, s, device)
    st = _Rows(len(prompts), max_new, torch.tensor(limits, dtype=torch.long, device=device), device)
    with torch.no_grad():
        dec = _Decoder(model, s, state)
        logits = dec.prefill(ids, mask, width + max_new)
        for step in range(max_new):
            tok, lp = sample(logits, rows, generator)
            st.record(step, tok, lp, (tok[:, None] == stops).any(-1))
            if step + 1 == max_new or ((step + 1) % s.sync_every == 0 and st.all_done()):
                break
            keep = None if s.static else st.compact()  # drop finished rows (dynamic cache only)
            if keep is not None:
                tok, rows, stops, lengths = tok[keep], rows.select(keep), stops[keep], lengths[keep]
                dec.select(keep)
            logits = dec.step(torch.where(st.done_now(), s.pad_token_id, tok), lengths + step, width + step)
    return _collect(st.tokens, st.logprobs, st.n_gen, _stop_table(params, s, device), real)


class _Rows:
    """Per-request progress in ORIGINAL row order while the batch shrinks (`active` maps current -> original)."""

    def __init__(self, batch: int, max_new: int, limits: torch.Tensor, device: torch.device) -> None:
        self.tokens = torch.zeros(batch, max_new, dtype=torch.long, device=device)
        self.logprobs = torch.zeros(batch, max_new, dtype=torch.float32, device=device)
        self.n_gen = torch.zeros(batch, dtype=torch.long, device=device)
        self.finished = torch.zeros(batch, dtype=torch.bool, device=device)
        self.limits = limits
        self.active: torch.Tensor | None = None  # None: all rows, in order

    def record(self, step: int, tok: torch.Tensor, lp: torch.Tensor, hit_stop: torch.Tensor) -> None:
        a = self.active if self.active is not None else slice(None)
        self.tokens[a, step] = tok
        self.logprobs[a, step] = lp.float()
        done = self.finished[a]
        n = torch.where(done, self.n_gen[a], self.n_gen[a] + 1)
        self.n_gen[a] = n
        self.finished[a] = done | hit_stop | (n >= self.limits[a])

    def done_now(self) -> torch.Tensor:
        return self.finished if self.active is None else self.finished[self.active]

    def all_done(self) -> bool:
        return bool(self.done_now().all())

    def compact(self) -> torch.Tensor | None:
        """Indices (into the current rows) to keep, when at least a quarter of them has finished."""
        done = self.done_now()
        n_done = int(done.sum())
        if n_done == 0 or n_done * 4 < done.numel():
            return None
        keep = (~done).nonzero().squeeze(1)
        base = self.active if self.active is not None else torch.arange(done.numel(), device=done.device)
        self.active = base[keep]
        return keep


def _collect(toks, lps, n_gen, stops, real: int) -> list[GenerateOutput]:
    toks_l, lps_l, n_l, stops_l = toks.cpu().tolist(), lps.float().cpu().tolist(), n_gen.tolist(), stops.tolist()
    outs = []
    for i in range(real):
        t, lp = toks_l[i][: n_l[i]], lps_l[i][: n_l[i]]
        reason = "stop" if t and t[-1] in stops_l[i] else "length"
        outs.append(GenerateOutput(token_ids=t, logprobs=lp, finish_reason=reason))
    return outs


class _Decoder:
    """Prefill + decode steps over one cache (dynamic or static); `select` shrinks a dynamic batch."""

    def __init__(self, model: Any, s: DecodeSettings, state: StaticState) -> None:
        self.model, self.s, self.state = model, s, state
        self.use_cache_position = _accepts(model, "cache_position")
        self.cache_kw = "cache" if _accepts(model, "cache") else "past_key_values"  # renamed in transformers 5.2x
        self.forward = model

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, total: int) -> torch.Tensor:
        """Run the left-padded prompts; returns the last position's logits [B, V]."""
        from transformers import DynamicCache, StaticCache

        s, batch, width = self.s, ids.shape[0], ids.shape[1]
        length = _bucket(total, s.length_bucket) if s.static else total
        # The padding mask covers every future position from the start: causality hides the future.
        self.attn = torch.cat([mask, torch.ones(batch, length - width, dtype=mask.dtype, device=mask.device)], 1)
        if s.static:
            self.cache = self.state.caches.get((batch, length))
            if self.cache is None:
                self.cache = StaticCache(config=self.model.config, max_cache_len=length)
                self.state.caches[(batch, length)] = self.cache
            self.cache.reset()
            if s.compile and self.state.compiled is None:
                self.state.compiled = _compile(self.model)
            self.forward = self.state.compiled if s.compile else self.model
        else:
            self.cache = DynamicCache(config=self.model.config)
        kw = {"cache_position": torch.arange(width, device=ids.device)} if self.use_cache_position else {}
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(
            input_ids=ids, attention_mask=self.attn if s.static else mask, position_ids=positions,
            use_cache=True, logits_to_keep=1, **{self.cache_kw: self.cache}, **kw,
        )  # fmt: skip
        return out.logits[:, -1].float()

    def step(self, tok: torch.Tensor, positions: torch.Tensor, offset: int) -> torch.Tensor:
        """Feed one token per row at cache slot `offset`; returns the next logits [B, V]."""
        kw = {"cache_position": torch.tensor([offset], device=tok.device)} if self.use_cache_position else {}
        if self.s.compile:
            torch.compiler.cudagraph_mark_step_begin()
        mask = self.attn if self.s.static else self.attn[:, : offset + 1]
        out = self.forward(
            input_ids=tok[:, None], attention_mask=mask, position_ids=positions[:, None],
            use_cache=True, **{self.cache_kw: self.cache}, **kw,
        )  # fmt: skip
        logits = out.logits[:, -1].float()
        return logits.clone() if self.s.compile else logits  # CUDA-graph outputs are overwritten by the next replay

    def select(self, keep: torch.Tensor) -> None:
        self.cache.batch_select_indices(keep)
        self.attn = self.attn[keep]


def _compile(model: Any) -> Any:
    logger.info("compiling the decode step (static cache, mode=reduce-overhead); the first batch is slow")
    _init_cudagraph_thread_state()
    return torch.compile(model.__call__, mode="reduce-overhead", fullgraph=False)


def _init_cudagraph_thread_state() -> None:
    """Make cudagraph trees usable from this (decode) thread.

    torch keeps the CUDA-graph tree managers in a threading.local that it fills
    only in the thread that first imported torch._inductor.cudagraph_trees; any
    other thread then fails `assert torch._C._is_key_in_tls(...)` (seen with
    torch 2.11 when `generate` compiled in the main thread first). Give this
    thread its own containers (torch 2.13 does this itself in `get_obj`); remove
    once the supported torch floor initialises every thread.
    """
    import threading
    from collections import defaultdict

    try:
        from torch._inductor import cudagraph_trees as ct
    except ImportError:  # a torch without inductor: nothing to prepare
        return
    if not hasattr(ct.local, "tree_manager_containers") and not torch._C._is_key_in_tls("tree_manager_containers"):
        ct.local.tree_manager_containers = {}
        ct.local.tree_manager_locks = defaultdict(threading.Lock)
