"""Runs the forwards the scheduler decided on, over the slot KV pool: prefill chunks and decode steps.

Decode steps have static shapes: rows 0..R-1 of the pool (R a power-of-two
bucket covering the highest busy slot) and the first `kv_len` cache columns
(a power-of-two bucket). Idle rows feed a pad token and write to the scratch
column. On CUDA each (R, kv_len) bucket is captured once as a CUDA graph
(lazily, or all at once by `capture_all`) and replayed; its inputs live in
one static buffer, which `decode_next` fills from the last step's samples on the
device (the engine's lookahead, continuous.py). Prefill chunks have varying shapes and run eagerly.
CPU runs the same code without graphs.

Graphs outlive sleep: the KV pool lives in an `Arena` (arena.py) whose memory `free()` gives back and
`ensure_pool()` takes again at the same addresses, and the engine keeps its weights in one too
(`fixed_weights`), so the recorded pointers stay valid and a wake records nothing. Where the driver
refuses fixed-address memory, `free()` drops the graphs as well and they are recorded again on use.

`capture` is the seam that records a step: `capture(step) -> (replay, out)`, where `step()` runs one
decode forward and returns its logits, `replay()` runs the recorded step again and `out` is the tensor it
writes. On CUDA it is a CUDA graph; CPU has none, so tests pass one that counts recordings (see
tests/engine/test_graphs_survive_sleep.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from verl_agent.engine.runner.arena import make_arena
from verl_agent.engine.runner.compile_cache import CompileCache, compile_key
from verl_agent.engine.runner.decode_step import DecodeStep
from verl_agent.engine.runner.fused_norms import FusedNorms
from verl_agent.engine.runner.kv_pool import KVBudget, SlotKVPool, slot_attention_enabled

GraphCapture = Callable[[Callable[[], torch.Tensor]], tuple[Callable[[], None], torch.Tensor]]

logger = logging.getLogger(__name__)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def cuda_graph_capture(pool: Any) -> GraphCapture:
    """Record a step as a CUDA graph with its memory in `pool`; the warm-up run writes what the replay writes."""

    def capture(step: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the trainer's thread keeps launching its own kernels (async modes) while we capture
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            out = step()
        return graph.replay, out

    return capture


def capture_factory(capture: GraphCapture | None, cuda_graphs: bool, device: torch.device
                    ) -> Callable[[], GraphCapture] | None:  # fmt: skip
    """What records decode graphs, made anew each time the graphs are dropped: a caller's `capture` (a CPU
    stand-in in tests), else on CUDA a fresh private memory pool (a pool whose graphs are all gone cannot be
    captured into again); None: decode eagerly."""
    if capture is not None:
        return lambda: capture
    if cuda_graphs and device.type == "cuda":
        return lambda: cuda_graph_capture(torch.cuda.graph_pool_handle())
    return None


class ModelRunner:
    def __init__(
        self, model: Any, budget: KVBudget, pad_id: int, cache_kw: str, cuda_graphs: bool,
        compile_decode: bool | None = False,
        fused_norms: bool = True, capture: GraphCapture | None = None, own_decode_step: bool = True,
    ) -> None:  # fmt: skip
        self.model, self.budget, self.pad_id, self.cache_kw = model, budget, pad_id, cache_kw
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self._new_capture = capture_factory(capture, cuda_graphs, self.device)
        self.capture = self._new_capture() if self._new_capture else None
        self.cuda_graphs = self.capture is not None  # decode steps are recorded and replayed
        self.fixed_weights = False  # the weights keep their addresses across sleep (arena.py, or borrowed)
        self.norms = FusedNorms(model) if fused_norms else None
        # Decode steps of a Llama-family model run the engine's own forward (decode_step.py), others
        # transformers' forward. torch.compile fuses each layer's small elementwise kernels (norms, rotary,
        # activation, residuals: dozens a layer, each a kernel of its own even inside a CUDA graph): our
        # forward's one layer function, compiled once for every layer, or else the whole model. Decode steps
        # only: their shapes come from a few buckets; prefill chunks change shape at nearly every call.
        # dynamic=None: the first bucket gets static kernels, the next shape one compile with dynamic sizes.
        # compile_decode None: our layer function on CUDA; transformers' forward only when asked (True).
        self.decode_step = DecodeStep.of(model, fused_norms=self.norms is not None) if own_decode_step else None
        compile_own = compile_decode or (compile_decode is None and self.device.type == "cuda")
        if compile_own and self.decode_step is not None:
            self.decode_step.compiled_layer = torch.compile(self.decode_step.layer, dynamic=None)
        compile_model = compile_decode is True and self.decode_step is None
        self.decode_model = torch.compile(model, dynamic=None) if compile_model else model
        compiled = compile_model or (compile_own and self.decode_step is not None)
        key = compile_key(model.config, self.dtype, self.device) if compiled else None
        self.compile_cache = CompileCache(key) if key else None
        if self.compile_cache is not None:  # earlier runs' compiles of this shape (compile_cache.py)
            self.compile_cache.load()
        self.min_kv = 256 if self.cuda_graphs else 64
        self.min_rows = 8 if self.cuda_graphs else 1
        self.pool: SlotKVPool | None = None
        self.graphs: dict[tuple[int, int], tuple[Callable[[], None], torch.Tensor]] = {}
        self.busy_s = 0.0  # engine-thread time in prefill chunks and decode steps (the batcher adds it)
        self.capture_s, self.captures = 0.0, 0  # graph recordings (once per bucket while addresses hold)

    @contextmanager
    def running(self) -> Iterator[None]:
        """The model as the engine runs it: attention over the slot pool, and the fused norms."""
        with slot_attention_enabled(self.model), (self.norms.active() if self.norms else nullcontext()):
            yield

    # -- memory ---------------------------------------------------------------------------------------
    def ensure_pool(self) -> SlotKVPool:
        if self.pool is None:
            b, cfg = self.budget, self.model.config
            arena = make_arena(SlotKVPool.arena_bytes(cfg, b.slots, b.length, self.dtype), self.device,
                               "KV cache") if self.cuda_graphs else None  # fmt: skip
            self.pool = SlotKVPool(cfg, b.slots, b.length, self.dtype, self.device, arena)
            self.buf = torch.zeros(3, b.slots, dtype=torch.long, device=self.device)  # ids, positions, active
            self.kv_arange = torch.arange(b.length, device=self.device)
        self.pool.commit()
        return self.pool

    @property
    def keeps_graphs(self) -> bool:
        """Whether the graphs survive `free()`: the KV pool and the weights are at fixed addresses."""
        return self.fixed_weights and self.pool is not None and self.pool.arena is not None

    def free(self, keep_graphs: bool = True) -> None:
        """Give the KV memory back (sleep). With fixed addresses the pool and the graphs stay, to be used
        again after `ensure_pool()`; otherwise (or keep_graphs=False) both are dropped."""
        if keep_graphs and self.keeps_graphs:
            assert self.pool is not None
            self.pool.release()
        else:
            self.pool = None
            self.drop_graphs("the KV pool was freed without fixed addresses")
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def drop_graphs(self, reason: str) -> None:
        """Forget the recorded decode graphs (each is recorded again on its next use), in a new memory pool."""
        if self.graphs:  # a recording on a warm step costs time: say why
            logger.info("dropped %d decode graphs: %s", len(self.graphs), reason)
        self.graphs = {}
        if self._new_capture is not None and self.cuda_graphs:
            self.capture = self._new_capture()

    # -- buckets ---------------------------------------------------------------------------------------
    def rows_bucket(self, n: int) -> int:
        return min(self.budget.slots, max(self.min_rows, _pow2(n)))

    def kv_bucket(self, n: int) -> int:
        if not self.cuda_graphs:  # no graphs to reuse: only round to a multiple of 64
            return min(self.budget.length, -(-n // 64) * 64)
        return min(self.budget.length, max(self.min_kv, _pow2(n)))

    # -- forwards --------------------------------------------------------------------------------------
    def _mask(self, visible: torch.Tensor) -> torch.Tensor:
        """Additive float mask (0 = visible) [B, 1, T, K] from a boolean one [B, T, K]."""
        zero = torch.zeros((), dtype=self.dtype, device=self.device)
        return torch.where(visible, zero, torch.finfo(self.dtype).min)[:, None]

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, model: Any = None
                 ) -> torch.Tensor:  # fmt: skip
        out = (self.model if model is None else model)(
            input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1,
            **{self.cache_kw: self.pool},
        )  # fmt: skip
        return out.logits[:, -1]

    @torch.no_grad()
    def prefill(self, chunks: list[tuple[int, list[int], int]]) -> torch.Tensor:
        """Write the K/V of each (slot, tokens, first position) row; returns each row's last logits [B, V]."""
        pool = self.ensure_pool()
        width = max(len(toks) for _, toks, _ in chunks)
        host = torch.zeros(3, len(chunks), width, dtype=torch.long)  # ids, positions, write columns
        host[0].fill_(self.pad_id)
        host[2].fill_(pool.scratch)
        for b, (_, toks, start) in enumerate(chunks):
            n = len(toks)
            host[0, b, width - n :] = torch.tensor(toks, dtype=torch.long)
            host[1, b, width - n :] = host[2, b, width - n :] = torch.arange(start, start + n)
        kv_len = self.kv_bucket(max(start + len(toks) for _, toks, start in chunks))
        dev = host.to(self.device, non_blocking=True)
        slots = torch.tensor([s for s, _, _ in chunks], dtype=torch.long).to(self.device, non_blocking=True)
        pool.ensure_clean(kv_len)
        mask = self._mask(self.kv_arange[:kv_len][None, None, :] <= dev[1][:, :, None])  # left pads see column 0
        pool.plan(dev[2], kv_len, rows=slots)
        with self.running():
            return self._forward(dev[0], dev[1], mask).float()

    @torch.no_grad()
    def decode(self, rows: int, ids: list[int], positions: list[int], active: list[int]) -> torch.Tensor:
        """One token for each of rows 0..rows-1 (inactive rows: pad, scratch column); returns logits [rows, V]."""
        self.ensure_pool()
        self.buf[:, :rows].copy_(torch.tensor([ids, positions, active], dtype=torch.long), non_blocking=True)
        return self._decode(rows, max(positions) + 1)

    @torch.no_grad()
    def decode_next(self, rows: int, ids: torch.Tensor, positions: list[int], active: list[int]) -> torch.Tensor:
        """`decode` whose ids are a device tensor [rows] (the last step's samples), copied in stream order, so
        the host never waits for them. Inactive rows feed whatever `ids` holds there instead of the pad token:
        they write only the scratch column and their logits are ignored."""
        self.ensure_pool()
        self.buf[1:, :rows].copy_(torch.tensor([positions, active], dtype=torch.long), non_blocking=True)
        self.buf[0, :rows].copy_(ids)
        return self._decode(rows, max(positions) + 1)

    def _decode(self, rows: int, n_columns: int) -> torch.Tensor:
        """The decode step over rows 0..rows-1 whose inputs are in `buf`, seeing `n_columns` cache columns."""
        assert self.pool is not None
        kv_len = self.kv_bucket(n_columns)
        self.pool.ensure_clean(kv_len)
        if not self.cuda_graphs:
            with self.running():
                out = self._decode_forward(rows, kv_len).float()
            if self.compile_cache is not None:
                self.compile_cache.saved_if_compiled()
            return out
        graph = self.graphs.get((rows, kv_len)) or self._capture(rows, kv_len)
        if graph is None:
            with self.running():
                return self._decode_forward(rows, kv_len).float()
        graph[0]()
        return graph[1].float()

    def _decode_forward(self, rows: int, kv_len: int) -> torch.Tensor:
        pool = self.pool
        assert pool is not None
        ids, pos, active = self.buf[0, :rows], self.buf[1, :rows], self.buf[2, :rows]
        write = torch.where(active.bool(), pos, pool.scratch)
        mask = self._mask((self.kv_arange[:kv_len][None, :] <= pos[:, None])[:, None, :])
        if self.decode_step is not None and self.decode_step.applies():
            return self.decode_step(ids, pos, write, mask, pool.k, pool.v, pool.row_ids[:rows])
        pool.plan(write[:, None], kv_len)
        return self._forward(ids[:, None], pos[:, None], mask, self.decode_model)

    def _capture(self, rows: int, kv_len: int) -> tuple[Callable[[], None], torch.Tensor] | None:
        """Record the decode step for one bucket."""
        assert self.capture is not None
        t0 = time.perf_counter()
        try:
            with self.running():
                replay, out = self.capture(lambda: self._decode_forward(rows, kv_len))
        except Exception:
            logger.exception("graph capture of the decode step failed; decoding eagerly from now on")
            self.cuda_graphs, self.capture = False, None
            return None
        self.graphs[(rows, kv_len)] = (replay, out)
        if self.compile_cache is not None:
            self.compile_cache.saved_if_compiled()
        dt = time.perf_counter() - t0
        self.capture_s, self.captures = self.capture_s + dt, self.captures + 1
        logger.info("captured decode graph rows=%d kv_len=%d in %.2fs", rows, kv_len, dt)
        return replay, out

    @torch.no_grad()
    def capture_all(self) -> int:
        """Capture every decode bucket now (largest first, so the smaller ones reuse its memory)."""
        if not self.cuda_graphs:
            return 0
        self.ensure_pool().ensure_clean(self.budget.length)
        self.buf.zero_()  # all rows idle: warm-up runs write only the scratch column
        rows = sorted({self.rows_bucket(1 << i) for i in range(self.budget.slots.bit_length() + 1)}, reverse=True)
        lens = sorted({self.kv_bucket(1 << i) for i in range(self.budget.length.bit_length() + 1)}, reverse=True)
        for r in rows:
            for k in lens:
                if (r, k) not in self.graphs and self._capture(r, k) is None:
                    return len(self.graphs)
        return len(self.graphs)
