"""The continuous-batching loop of `HFEngine`: requests in, one engine step at a time, results out.

Threads: `generate` (event loop) appends to an inbox and, if the loop is not
running, submits `serve` to the engine's single decode thread; `serve` runs
steps until there is no work left, then returns, so control calls queued on
the same thread (weight updates, sleep) run between bursts of work. Results
go back to the event loop with `call_soon_threadsafe`.

A failed forward fails the requests of that step and no other; a request that
can never fit in a KV slot is refused in `generate` before it is queued.

Lookahead (`decode_lookahead`): a decode step's tokens go to the host in a non-blocking copy, and while they
do, the host launches the next step from those tokens as they lie on the device, when that step is certain
to decode the same rows: no prefill chunk due, no slot compaction, nothing in the inbox, no row ending by
length or cancelled, and every row of the step still decoding. Only then does it wait for the earlier
step's tokens and record them, so on a GPU that bookkeeping overlaps the next step. A row whose request
ended on its recorded token (a stop token, a cancel) has a wasted result in the step already launched,
which is discarded. Otherwise the step in flight is first drained (waited for and recorded) and the loop
goes on as without the lookahead; nothing outside `step` ever sees a step in flight.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import torch

from verl_agent.engine.contract import SamplingParams
from verl_agent.engine.runner.kv_pool import KVBudget
from verl_agent.engine.runner.model_runner import GraphCapture, ModelRunner
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


@dataclass
class _Step:
    """A launched decode step whose tokens are on their way to the host."""

    rows_of: list[tuple[Seq, int]]  # each decoding sequence and its row
    rows: int
    positions: list[int]  # per row, as fed (0 for idle rows)
    active: list[int]
    params: RowParams
    tokens: torch.Tensor  # sampled, on the device [rows]: the next step's ids
    host_tokens: torch.Tensor  # tokens and log-probs on the host, once `ready` has passed
    host_logprobs: torch.Tensor
    ready: torch.cuda.Event | None  # None on CPU, where everything already ran

    def results(self) -> tuple[list[int], list[float]]:
        if self.ready is not None:
            self.ready.synchronize()
        return self.host_tokens.tolist(), self.host_logprobs.tolist()


def _to_host(tokens: torch.Tensor, logprobs: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.cuda.Event | None]:  # fmt: skip
    """Copies into pinned host memory and the event after which they hold the values. Queued now, so waiting on
    the event does not wait for work queued later (the next step)."""
    if tokens.device.type != "cuda":
        return tokens, logprobs, None
    host_tokens, host_logprobs = (torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                                  for t in (tokens, logprobs))  # fmt: skip
    event = torch.cuda.Event()
    event.record()
    return host_tokens, host_logprobs, event


class ContinuousBatcher:
    def __init__(
        self, model: Any, budget: KVBudget, *, pad_id: int, cache_kw: str, cuda_graphs: bool,
        max_num_batched_tokens: int, generator: torch.Generator, compile_decode: bool | None = False,
        fused_norms: bool = True, capture: GraphCapture | None = None, own_decode_step: bool = True,
        decode_lookahead: bool = True, share_prompts: bool = True,
    ) -> None:  # fmt: skip
        self.runner = ModelRunner(model, budget, pad_id, cache_kw, cuda_graphs, compile_decode, fused_norms, capture,
                                  own_decode_step)  # fmt: skip
        self.sched = Scheduler(budget.slots, max_num_batched_tokens, share_prompts)
        self.budget = budget
        self.generator = generator
        self.decode_lookahead = decode_lookahead
        self._inflight: _Step | None = None  # a decode step launched and not yet recorded
        self._inbox: deque[Seq | tuple[str, str]] = deque()
        self._lock = threading.Lock()
        self._serving = False
        self.closed = False
        self._last_prefill_s = 0.0  # duration of the last prefill chunk
        self._decode_s_since_prefill = 0.0
        self.counters: dict[str, float] = {"requests": 0, "generated_tokens": 0, "prefill_tokens": 0, "decode_steps": 0,
                         "prefill_chunks": 0, "decode_rows": 0, "failed_requests": 0,
                         "prefill_s": 0.0, "decode_s": 0.0, "slot_swaps": 0, "requests_interrupted": 0,
                         "decode_lookahead_steps": 0, "decode_wasted_rows": 0}  # fmt: skip

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
        """Run steps until there is no work left; returns with no step in flight, so that control calls (weight
        updates, sleep) queued after it never meet one."""
        try:
            while True:
                with self._lock:
                    items = list(self._inbox)
                    self._inbox.clear()
                    if not items and not self.sched.has_work() and self._inflight is None:
                        self._serving = False
                        return
                if items or self.closed:  # they act on the requests as the last step left them
                    self._drain()
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
            self._inflight = None
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
        its last rows finish far behind its first.

        With a decode step in flight, either the next one is launched ahead of recording it (`_decode_ahead`),
        or it is drained first and the step goes on as above."""
        if self._inflight is not None:
            if self._can_look_ahead(self._inflight):
                self._decode_ahead()
                return
            self._drain()
        swaps = self.sched.compact(self.runner.rows_bucket)
        if swaps:
            self.runner.ensure_pool().swap(swaps)
            self.counters["slot_swaps"] += len(swaps)
        decoding = self.sched.decoding()
        if self.sched.wants_prefill() and (not decoding or self._prefill_due()):
            chunks = self.sched.schedule_prefill()
            if chunks:
                self._prefill(chunks)
                shared = self.sched.schedule_shared()  # the samples of a group whose first one was just prefilled
                if shared:
                    self._prefill(shared, follow_up=True)
                decoding = self.sched.decoding()
        if decoding:
            self._decode(decoding)

    def _prefill_due(self) -> bool:
        due = self._decode_s_since_prefill >= PREFILL_PACING * self._last_prefill_s
        return due or self.sched.ready_tokens() >= self.sched.budget or self.sched.last_chunk_full

    def _prefill(self, chunks: list[Chunk], follow_up: bool = False) -> None:
        """One prefill forward over `chunks` (a follow-up's duration adds to the chunk it follows, for pacing)."""
        t0 = time.perf_counter()
        try:
            copies = self.sched.take_copies()
            if copies:
                self.runner.ensure_pool().copy_prefix(copies)
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
        dt = time.perf_counter() - t0
        self._last_prefill_s = self._last_prefill_s + dt if follow_up else dt
        self._decode_s_since_prefill = 0.0
        self.runner.busy_s += dt
        self.counters["prefill_s"] += dt
        self.counters["prefill_chunks"] += 1
        for s, a, b in chunks:
            s.n_cached = b
            self.counters["prefill_tokens"] += b - a
        if sampled is not None:
            for i, tok, lp in zip(done, *sampled):
                seq = chunks[i][0]
                seq.state = SeqState.DECODE
                self._record(seq, tok, lp)

    # Decode steps. decode_s (and busy_s, _decode_s_since_prefill) counts the engine thread's time in them:
    # building inputs, launching, waiting for tokens and recording them. With the lookahead the device runs
    # the next step meanwhile, so per step this is the engine's time, not the device's.
    def _decode(self, seqs: list[Seq]) -> None:
        """Launch a decode step over `seqs` from the host's tokens; it stays in flight with the lookahead."""
        t0 = time.perf_counter()
        rows = self.runner.rows_bucket(max(s.slot for s in seqs) + 1)
        ids, pos, active = [self.runner.pad_id] * rows, [0] * rows, [0] * rows
        by_row: list[Seq | None] = [None] * rows
        for s in seqs:
            ids[s.slot], pos[s.slot], active[s.slot], by_row[s.slot] = s.out_ids[-1], s.position, 1, s
        try:
            params = _row_params(by_row, self.runner.device)
            self._inflight = self._launch([(s, s.slot) for s in seqs], rows, ids, pos, active, params)
        except Exception as e:  # noqa: BLE001 - fail this step's requests, keep serving the rest
            self._fail(seqs, e)
            return
        finally:
            self._add_decode_time(t0)
        if not self.decode_lookahead:
            self._drain()

    def _can_look_ahead(self, step: _Step) -> bool:
        """Whether the step after `step` decodes exactly its rows whatever tokens it sampled (see `step`)."""
        if not self.decode_lookahead or self.closed or self._inbox:  # the inbox unlocked: a hint, items wait a step
            return False
        for s, _ in step.rows_of:  # every row still decoding, and none ending on `step`'s token for sure
            if s.state is not SeqState.DECODE or len(s.out_ids) + 1 >= s.max_new or s.future.done():
                return False
        if self.sched.prefill_ready() and self._prefill_due():
            return False
        return not self.sched.needs_compaction(self.runner.rows_bucket)

    def _decode_ahead(self) -> None:
        """Launch the step after the one in flight from its tokens on the device, then record that one.

        A row whose request ends on the recorded token has fed that token into the launched step, which writes
        its K/V at column position + 1 of the row's slot. Harmless: a parked session keeps n_cached = its
        tokens - 1, which leaves that column out (`Scheduler.finish`, `_reusable`), and its next turn writes
        from there on; a slot freed for another request is prefilled or decoded by it, and each forward writes
        its columns before its mask shows them (the mask shows columns <= a row's position). The device runs
        those writes after the wasted step, in stream order."""
        t0 = time.perf_counter()
        prev = self._inflight
        assert prev is not None
        pos = [p + 1 if a else 0 for p, a in zip(prev.positions, prev.active)]
        try:  # the same RowParams: each seeded row draws its next number from its own RNG, in order
            self._inflight = self._launch(prev.rows_of, prev.rows, prev.tokens, pos, prev.active, prev.params)
        except Exception as e:  # noqa: BLE001 - the failed step's requests are the one in flight's
            self._inflight = None
            self._fail([s for s, _ in prev.rows_of], e)
        else:
            self.counters["decode_lookahead_steps"] += 1
            self._record_step(prev)
        finally:
            self._add_decode_time(t0)

    def _launch(self, rows_of: list[tuple[Seq, int]], rows: int, ids: list[int] | torch.Tensor, pos: list[int],
                active: list[int], params: RowParams) -> _Step:  # fmt: skip
        """Queue a decode step, its sampling and the copy of its tokens to the host; waits for nothing on CUDA."""
        if isinstance(ids, torch.Tensor):
            logits = self.runner.decode_next(rows, ids, pos, active)
        else:
            logits = self.runner.decode(rows, ids, pos, active)
        tok, lp = sample(logits, params, self.generator)
        self.counters["decode_steps"] += 1
        return _Step(rows_of, rows, pos, active, params, tok, *_to_host(tok, lp))

    def _drain(self) -> None:
        """Wait for the step in flight, if any, and record its tokens."""
        step, self._inflight = self._inflight, None
        if step is not None:
            t0 = time.perf_counter()
            self._record_step(step)
            self._add_decode_time(t0)

    def _record_step(self, step: _Step) -> None:
        try:
            tok_l, lp_l = step.results()
        except Exception as e:  # noqa: BLE001 - an asynchronous failure of the step, seen when waiting for it
            self._fail([s for s, _ in step.rows_of if s.state is SeqState.DECODE], e)
            return
        for s, row in step.rows_of:
            if s.state is not SeqState.DECODE:  # ended on the step before: a lookahead row, discarded
                self.counters["decode_wasted_rows"] += 1
                continue
            self.counters["decode_rows"] += 1
            self._record(s, tok_l[row], lp_l[row])

    def _add_decode_time(self, t0: float) -> None:
        dt = time.perf_counter() - t0
        self.runner.busy_s += dt
        self._decode_s_since_prefill += dt
        self.counters["decode_s"] += dt

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
        self._drain()
        for seq in self.sched.drain():
            seq.resolve("abort")

    # -- control (run on the engine thread, between bursts) -------------------------------------------------
    def drop_sessions(self) -> None:
        assert self._inflight is None  # `serve` returns with nothing in flight
        self.sched.table.drop_idle()

    def free_memory(self) -> None:
        assert self._inflight is None
        self.sched.table.drop_idle()
        self.runner.free()
