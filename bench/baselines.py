"""Per-batch scheduling, the baseline the benchmarks compare the hf engine's continuous scheduler with.

`PerBatchEngine` runs up to `max_batch_size` waiting requests as one batch until its last row has
finished; requests that arrive meanwhile form the next batch. Each batch is left-padded, prefilled
whole (no KV reuse across turns) and decoded step by step:

- dynamic cache (CPU default): a `DynamicCache` that grows each step, eager forward; finished rows
  leave the batch once a quarter of it has finished.
- static cache (CUDA default): a `StaticCache` of fixed shape [batch bucket, heads, length bucket, dim]
  and a `torch.compile`d decode step (CUDA graphs via mode "reduce-overhead"); shapes never change
  during decoding (the padding mask covers the whole cache length from the start, causality hides the
  future positions) and finished rows keep running, their tokens discarded.

Bench-only: the engine in verl_agent schedules continuously. Implements the parts of `Engine` the
benchmarks call (generate, release_session, metrics, close).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from verl_agent.engine.contract import GenerateOutput, SamplingParams
from verl_agent.engine.backends.hf_engine import _eos_ids, _pad_id
from verl_agent.engine.sampling import RowParams, row_rng, sample

__all__ = ["PerBatchEngine"]


@dataclass
class _Settings:
    pad_token_id: int
    stop_ids: list[int]  # the model's eos ids, added to every request's stop ids
    static: bool  # static KV cache, fixed shapes
    compile: bool  # torch.compile the decode step (CUDA graphs); needs static
    sync_every: int  # check "all finished" every k steps (each check is a device sync)
    max_length: int | None  # model context limit
    length_bucket: int = 128


@dataclass
class _StaticState:
    """Static caches and the compiled decode call, kept across batches (same shapes: no recompiles)."""

    caches: dict[tuple[int, int], Any] = field(default_factory=dict)
    compiled: Any = None


@dataclass
class _Request:
    prompt_ids: list[int]
    sampling: SamplingParams
    future: asyncio.Future


class PerBatchEngine:
    """Per-batch generation on a transformers causal LM (already on `device`)."""

    def __init__(self, model: Any, *, device: str = "cpu", max_batch_size: int = 64, stop_on_eos: bool = True,
                 seed: int = 0, static: bool | None = None, compile: bool | None = None) -> None:  # fmt: skip
        self.model, self.device, self.max_batch_size = model.eval(), torch.device(device), max_batch_size
        static = self.device.type == "cuda" if static is None else static
        vocab = int(model.get_input_embeddings().weight.shape[0])
        self.settings = _Settings(
            pad_token_id=_pad_id(model, vocab), stop_ids=_eos_ids(model) if stop_on_eos else [], static=static,
            compile=(static and self.device.type == "cuda") if compile is None else compile,
            sync_every=8 if static else 1, max_length=getattr(model.config, "max_position_embeddings", None),
        )  # fmt: skip
        self._static = _StaticState()
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="per-batch-decode")
        self._pending: list[_Request] = []
        self._event: asyncio.Event | None = None
        self._server: asyncio.Task | None = None
        self.stats = {"batches": 0, "requests": 0, "generated_tokens": 0, "busy_s": 0.0}

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, *, session: str | None = None
                       ) -> GenerateOutput:  # fmt: skip
        """Queue one request (no KV reuse: `session` is accepted for the benchmarks' call shape only)."""
        if self._server is None or self._server.done():
            self._event = asyncio.Event()
            self._server = asyncio.get_running_loop().create_task(self._serve())
        fut = asyncio.get_running_loop().create_future()
        self._pending.append(_Request(list(prompt_ids), sampling, fut))
        assert self._event is not None
        self._event.set()
        return await fut

    async def release_session(self, session: str) -> None:
        """Nothing is kept per session."""

    def metrics(self) -> dict[str, float]:
        return {f"engine/{k}": float(v) for k, v in self.stats.items()}

    async def close(self) -> None:
        if self._server is not None:
            self._server.cancel()
            await asyncio.gather(self._server, return_exceptions=True)
        for r in self._pending:
            if not r.future.done():
                r.future.set_result(GenerateOutput([], [], "abort"))
        self._executor.shutdown(wait=True)

    async def _serve(self) -> None:
        assert self._event is not None
        while True:
            await self._event.wait()
            self._event.clear()
            await asyncio.sleep(0)  # let every task that is ready right now queue its request too
            while self._pending:
                batch = [r for r in self._pending[: self.max_batch_size] if not r.future.done()]
                del self._pending[: self.max_batch_size]
                if batch:
                    await self._run(batch)

    async def _run(self, batch: list[_Request]) -> None:
        t0 = time.perf_counter()
        try:
            outs = await asyncio.get_running_loop().run_in_executor(
                self._executor, decode_batch, self.model, [r.prompt_ids for r in batch],
                [r.sampling for r in batch], self.settings, self._static, self._generator,
            )  # fmt: skip
        except Exception as e:  # noqa: BLE001 - one bad batch fails its own requests
            for r in batch:
                if not r.future.done():
                    r.future.set_exception(e)
            return
        self.stats["busy_s"] += time.perf_counter() - t0
        self.stats["batches"] += 1
        self.stats["requests"] += len(batch)
        for r, out in zip(batch, outs):
            self.stats["generated_tokens"] += len(out.token_ids)
            if not r.future.done():
                r.future.set_result(out)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _accepts(model: Any, name: str) -> bool:
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def _left_pad(prompts: Sequence[Sequence[int]], pad_id: int, width: int, device: torch.device):
    """Left-pad prompts to `width`; returns (ids [B, width], mask [B, width], lengths [B])."""
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    lengths = torch.tensor([len(p) for p in prompts], dtype=torch.long)
    return ids.to(device), mask.to(device), lengths.to(device)


def _stop_table(params: Sequence[SamplingParams], s: _Settings, device: torch.device) -> torch.Tensor:
    rows = [sorted(set(p.stop_token_ids) | set(s.stop_ids)) or [-1] for p in params]
    width = max(len(r) for r in rows)
    return torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.long, device=device)


def _select(rows: RowParams, keep: torch.Tensor) -> RowParams:
    """The rows at `keep` (a dynamic batch shrinks when requests finish)."""
    temp, top_p, top_k = rows.temperature[keep], rows.top_p[keep], rows.top_k[keep]
    sampled = temp > 0
    return RowParams(
        temperature=temp, top_p=top_p, top_k=top_k, rngs=[rows.rngs[i] for i in keep.tolist()],
        any_filter=bool((((top_k > 0) | (top_p < 1.0)) & sampled).any()),
        any_greedy=bool((~sampled).any()), all_greedy=bool((~sampled).all()),
    )  # fmt: skip


def decode_batch(model: Any, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams], s: _Settings,
                 state: _StaticState, generator: torch.Generator | None) -> list[GenerateOutput]:  # fmt: skip
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
    ids, mask, lengths = _left_pad(prompts, s.pad_token_id, width, device)
    rows = RowParams.of(params, [row_rng(p) for p in params], device)
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
                tok, rows, stops, lengths = tok[keep], _select(rows, keep), stops[keep], lengths[keep]
                dec.select(keep)
            logits = dec.step(torch.where(st.done_now(), s.pad_token_id, tok), lengths + step, width + step)
    return _collect(st, _stop_table(params, s, device), real)


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


def _collect(st: _Rows, stops: torch.Tensor, real: int) -> list[GenerateOutput]:
    toks, lps, n_gen, stop_l = st.tokens.cpu().tolist(), st.logprobs.cpu().tolist(), st.n_gen.tolist(), stops.tolist()
    outs = []
    for i in range(real):
        t, lp = toks[i][: n_gen[i]], lps[i][: n_gen[i]]
        reason = "stop" if t and t[-1] in stop_l[i] else "length"
        outs.append(GenerateOutput(token_ids=t, logprobs=lp, finish_reason=reason))
    return outs


class _Decoder:
    """Prefill + decode steps over one cache (dynamic or static); `select` shrinks a dynamic batch."""

    def __init__(self, model: Any, s: _Settings, state: _StaticState) -> None:
        self.model, self.s, self.state = model, s, state
        self.use_cache_position = _accepts(model, "cache_position")
        self.cache_kw = "cache" if _accepts(model, "cache") else "past_key_values"
        self.forward = model

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor, total: int) -> torch.Tensor:
        """Run the left-padded prompts; returns the last position's logits [B, V]."""
        from transformers import DynamicCache, StaticCache

        s, batch, width = self.s, ids.shape[0], ids.shape[1]
        length = -(-total // s.length_bucket) * s.length_bucket if s.static else total
        # The padding mask covers every future position from the start: causality hides the future.
        self.attn = torch.cat([mask, torch.ones(batch, length - width, dtype=mask.dtype, device=mask.device)], 1)
        if s.static:
            self.cache = self.state.caches.get((batch, length))
            if self.cache is None:
                self.cache = self.state.caches[(batch, length)] = StaticCache(config=self.model.config,
                                                                              max_cache_len=length)
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
    _init_cudagraph_thread_state()
    return torch.compile(model.__call__, mode="reduce-overhead", fullgraph=False)


def _init_cudagraph_thread_state() -> None:
    """Make cudagraph trees usable from this (decode) thread: torch keeps their managers in a
    threading.local that some torch releases fill only in the thread that first imported
    torch._inductor.cudagraph_trees; give this thread its own containers where they are missing."""
    from collections import defaultdict

    try:
        from torch._inductor import cudagraph_trees as ct
    except ImportError:  # a torch without inductor: nothing to prepare
        return
    if not hasattr(ct.local, "tree_manager_containers") and not torch._C._is_key_in_tls("tree_manager_containers"):
        ct.local.tree_manager_containers = {}
        ct.local.tree_manager_locks = defaultdict(threading.Lock)
