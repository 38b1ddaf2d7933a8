"""The continuous-batching loop of `HFEngine`: requests in, one engine step at a time, results out.

Threads: `generate` (event loop) appends to an inbox and, if the loop is not
running, submits `serve` to the engine's single decode thread; `serve` runs
steps until there is no work left, then returns, so control calls queued on
the same thread (weight updates, sleep) run between bursts of work. Results
go back to the event loop with `call_soon_threadsafe`.

A failed forward fails the requests of that step and no other; a request that
can never fit in a KV slot is refused in `generate` before it is queued.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

import torch

from verl_agent.engine.contract import SamplingParams
from verl_agent.engine.kv_pool import KVBudget
from verl_agent.engine.model_runner import GraphCapture, ModelRunner
from verl_agent.engine.sampling import RowParams, row_rng, sample
from verl_agent.engine.scheduler import Chunk, Scheduler
from verl_agent.engine.sequence import Seq, SeqState

logger = logging.getLogger(__name__)


PREFILL_PACING = 2.0  # decode time between prefill chunks, in units of the last chunk's duration


class KVCacheOverflowError(ValueError):
    """A request can never fit in one KV slot (its prompt is longer than a slot holds)."""


def _row_params(seqs: list[Seq | None], device: torch.device) -> RowParams:
    """Sampling settings for a batch whose row i belongs to seqs[i] (None: an idle row, sampled greedily)."""
    return RowParams.of([s.sampling if s is not None else None for s in seqs],
                        [s.rng if s is not None else None for s in seqs], device)


class ContinuousBatcher:
    def __init__(
        self, model: Any, budget: KVBudget, *, pad_id: int, cache_kw: str, cuda_graphs: bool,
        max_num_batched_tokens: int, generator: torch.Generator, compile_decode: bool | None = False,
        fused_norms: bool = True, capture: GraphCapture | None = None, own_decode_step: bool = True,
    ) -> None:  # fmt: skip
        self.runner = ModelRunner(model, budget, pad_id, cache_kw, cuda_graphs, compile_decode, fused_norms, capture,
                                  own_decode_step)  # fmt: skip
        self.sched = Scheduler(budget.slots, max_num_batched_tokens)
        self.budget = budget
        self.generator = generator
        self._inbox: deque[Seq | tuple[str, str]] = deque()
        self._lock = threading.Lock()
        self._serving = False
        self.closed = False
        self._last_prefill_s = 0.0  # duration of the last prefill chunk
        self._decode_s_since_prefill = 0.0
        self.counters: dict[str, float] = {"requests": 0, "generated_tokens": 0, "prefill_tokens": 0, "decode_steps": 0,
                         "prefill_chunks": 0, "decode_rows": 0, "failed_requests": 0,
                         "prefill_s": 0.0, "decode_s": 0.0, "slot_swaps": 0, "requests_interrupted": 0}  # fmt: skip

    # -- event-loop side -----------------------------------------------------------------------------------
    def make_seq(
        self, prompt: list[int], sampling: SamplingParams, session: str | None, eos: frozenset[int],
        loop: asyncio.AbstractEventLoop, on_token: Callable[[int, float], None] | None = None,
    ) -> Seq:  # fmt: skip
        """A request ready to submit; refuses one whose prompt can never fit in a slot."""
        b = self.budget
        if len(prompt) > b.length:
            raise KVCacheOverflowError(
                f"HFEngine.generate: a prompt of {len(prompt)} tokens cannot fit in a KV slot of {b.length} tokens "
                f"({b.describe()}); raise rollout.max_model_len or rollout.gpu_memory_utilization, "
                f"or lower rollout.max_num_seqs"
            )
        return Seq(
            prompt, sampling, max_new=min(sampling.max_new_tokens, b.length - len(prompt) + 1),
            stops=eos.union(sampling.stop_token_ids), future=loop.create_future(), loop=loop,
            session=session, rng=row_rng(sampling), on_token=on_token,
        )  # fmt: skip

    def submit(self, item: Seq | tuple[str, str], executor: Executor) -> None:
        with self._lock:
            self._inbox.append(item)
            start, self._serving = not self._serving, True
        if start:
            executor.submit(self.serve)

    # -- engine-thread side --------------------------------------------------------------------------------
    def serve(self) -> None:
        try:
            while True:
                with self._lock:
                    items = list(self._inbox)
                    self._inbox.clear()
                    if not items and not self.sched.has_work():
                        self._serving = False
                        return
                for item in items:
                    if isinstance(item, Seq):
                        self.sched.add(item)
                    elif item[0] == "interrupt":  # at a token boundary: every request so far ends now
                        self.counters["requests_interrupted"] += len(self.sched.waiting) + len(self.sched.running)
                        self.abort_all()
                    else:
                        self.sched.release(item[1])
                if self.closed:
                    self.abort_all()
                    continue
                self.step()
        except BaseException as e:  # a bug in the loop: fail every request rather than leave callers waiting
            logger.exception("HFEngine continuous loop crashed")
            for seq in self.sched.drain():
                seq.fail(e)
            with self._lock:
                self._serving = False
            raise

    def step(self) -> None:
        """At most one prefill chunk, then one decode step.

        Pacing: while sequences are decoding, a prefill chunk runs only once the decode time since the
        last chunk has reached PREFILL_PACING x that chunk's duration, so prefills take at most about a
        third of the busy time. A prefill chunk costs about as much as many decode steps, whatever its
        size, so waiting lets arrivals share one chunk. A chunk also runs at once when nothing is decoding
        (a lone request is not delayed), when a full chunk (`max_num_batched_tokens`) is waiting, or when
        the last chunk was cut by that budget with more prompt tokens ready: a burst, or a long prompt, is
        prefilled back to back (one decode step between chunks) rather than spread out, which would make
        its last rows finish far behind its first."""
        swaps = self.sched.compact(self.runner.rows_bucket)
        if swaps:
            self.runner.ensure_pool().swap(swaps)
            self.counters["slot_swaps"] += len(swaps)
        decoding = self.sched.decoding()
        due = self._decode_s_since_prefill >= PREFILL_PACING * self._last_prefill_s
        due = due or self.sched.ready_tokens() >= self.sched.budget or self.sched.last_chunk_full
        if self.sched.wants_prefill() and (not decoding or due):
            chunks = self.sched.schedule_prefill()
            if chunks:
                self._prefill(chunks)
                decoding = self.sched.decoding()
        if decoding:
            self._decode(decoding)

    def _prefill(self, chunks: list[Chunk]) -> None:
        t0 = time.perf_counter()
        try:
            logits = self.runner.prefill([(s.slot, s.prompt[a:b], a) for s, a, b in chunks])
            done = [i for i, (s, _, b) in enumerate(chunks) if b == len(s.prompt)]
            sampled = None
            if done:
                seqs = [chunks[i][0] for i in done]
                tok, lp = sample(logits[done], _row_params(seqs, logits.device), self.generator)
                sampled = (tok.tolist(), lp.tolist())
            else:
                logits.sum().item()  # synchronise, so that busy time is measured
        except Exception as e:  # noqa: BLE001 - fail this step's requests, keep serving the rest
            self._fail([s for s, _, _ in chunks], e)
            return
        self._last_prefill_s = time.perf_counter() - t0
        self._decode_s_since_prefill = 0.0
        self.runner.busy_s += self._last_prefill_s
        self.counters["prefill_s"] += self._last_prefill_s
        self.counters["prefill_chunks"] += 1
        for s, a, b in chunks:
            s.n_cached = b
            self.counters["prefill_tokens"] += b - a
        if sampled is not None:
            for i, tok, lp in zip(done, *sampled):
                seq = chunks[i][0]
                seq.state = SeqState.DECODE
                self._record(seq, tok, lp)

    def _decode(self, seqs: list[Seq]) -> None:
        rows = self.runner.rows_bucket(max(s.slot for s in seqs) + 1)
        ids, pos, active = [self.runner.pad_id] * rows, [0] * rows, [0] * rows
        by_row: list[Seq | None] = [None] * rows
        for s in seqs:
            ids[s.slot], pos[s.slot], active[s.slot], by_row[s.slot] = s.out_ids[-1], s.position, 1, s
        t0 = time.perf_counter()
        try:
            logits = self.runner.decode(rows, ids, pos, active)
            tok, lp = sample(logits, _row_params(by_row, logits.device), self.generator)
            tok_l, lp_l = tok.tolist(), lp.tolist()
        except Exception as e:  # noqa: BLE001
            self._fail(seqs, e)
            return
        dt = time.perf_counter() - t0
        self.runner.busy_s += dt
        self._decode_s_since_prefill += dt
        self.counters["decode_s"] += dt
        self.counters["decode_steps"] += 1
        self.counters["decode_rows"] += len(seqs)
        for s in seqs:
            self._record(s, tok_l[s.slot], lp_l[s.slot])

    def _record(self, seq: Seq, tok: int, lp: float) -> None:
        reason = seq.append(tok, lp)
        if reason is None and seq.future.done():  # the caller went away (cancelled)
            reason = "abort"
        if reason is not None:
            self.counters["generated_tokens"] += len(seq.out_ids)
            self.counters["requests"] += 1
            self.sched.finish(seq, keep_session=reason != "abort")
            seq.resolve(reason)

    def _fail(self, seqs: list[Seq], error: Exception) -> None:
        logger.error("HFEngine step failed for %d request(s): %r", len(seqs), error)
        for s in seqs:
            self.counters["failed_requests"] += 1
            self.sched.finish(s, keep_session=False)
            s.fail(error)

    def abort_all(self) -> None:
        for seq in self.sched.drain():
            seq.resolve("abort")

    # -- control (run on the engine thread, between bursts) -------------------------------------------------
    def drop_sessions(self) -> None:
        self.sched.table.drop_idle()

    def free_memory(self) -> None:
        self.sched.table.drop_idle()
        self.runner.free()
