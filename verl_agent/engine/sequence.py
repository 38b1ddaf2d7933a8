"""One request's state inside the continuous-batching engine."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from verl_agent.engine.contract import FinishReason, GenerateOutput, SamplingParams


class SeqState(Enum):
    WAITING = "waiting"  # queued, no slot yet
    PREFILL = "prefill"  # owns a slot; prompt tokens [n_cached:] still to be written
    DECODE = "decode"  # prompt done; out_ids[-1] is sampled and not yet fed
    DONE = "done"


@dataclass(eq=False)
class Seq:
    """A request: its prompt, limits and progress; `n_cached` prompt tokens have K/V in `slot`."""

    prompt: list[int]
    sampling: SamplingParams
    max_new: int  # max_new_tokens, clamped to what the slot can hold
    stops: frozenset[int]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    session: str | None = None
    rng: random.Random | None = None  # a seeded request's sampling numbers (sampling.row_rng)
    on_token: Callable[[int, float], None] | None = None  # called on `loop` for each token (streaming)
    state: SeqState = SeqState.WAITING
    slot: int = -1
    n_cached: int = 0
    est_prefill: int = 0  # prompt tokens expected to need a prefill (set when queued)
    donor: Seq | None = None  # a running request with the same prompt, whose prompt K/V this one will copy
    out_ids: list[int] = field(default_factory=list)
    out_lps: list[float] = field(default_factory=list)
    submitted: float = field(default_factory=time.perf_counter)

    @property
    def position(self) -> int:
        """Position of the token fed next in a decode step (the last sampled one)."""
        return len(self.prompt) + len(self.out_ids) - 1

    def append(self, token: int, logprob: float) -> FinishReason | None:
        """Record one sampled token; returns why the request ends now, or None."""
        self.out_ids.append(token)
        self.out_lps.append(logprob)
        if self.on_token is not None:  # scheduled before `resolve`'s result, so the caller sees every token first
            self.loop.call_soon_threadsafe(self.on_token, token, logprob)
        if token in self.stops:
            return "stop"
        if len(self.out_ids) >= self.max_new:
            return "length"
        return None

    def resolve(self, reason: FinishReason) -> None:
        self.state = SeqState.DONE
        out = GenerateOutput(token_ids=list(self.out_ids), logprobs=list(self.out_lps), finish_reason=reason)
        self.loop.call_soon_threadsafe(_set_result, self.future, out)

    def fail(self, error: BaseException) -> None:
        self.state = SeqState.DONE
        self.loop.call_soon_threadsafe(_set_exception, self.future, error)


def _set_result(fut: asyncio.Future, out: GenerateOutput) -> None:
    if not fut.done():
        fut.set_result(out)


def _set_exception(fut: asyncio.Future, error: BaseException) -> None:
    if not fut.done():
        fut.set_exception(error)
