"""`ScriptedEngine`: an `Engine` that replies with scripted text, token-exactly and instantly.

For tests of agent loops, tools and interactions (exact, known token sequences
independent of any model) and for measuring agent-loop overhead without model
cost (bench/rollout.py). It is a real `Engine`: `check_engine` passes on it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

from verl_agent.engine.contract import GenerateOutput, SamplingParams

__all__ = ["ScriptedEngine"]

Script = Callable[[list[int], SamplingParams], str]


class ScriptedEngine:
    """Replies `script(prompt_ids, sampling)` encoded with `tokenizer`, followed by `eos_id`.

    The reply is cut at `max_new_tokens` (finish "length") or at the first stop id
    (finish "stop"). Every token gets log-prob `logprob`. `delay` seconds of
    asyncio sleep simulate generation time without using the CPU.
    """

    def __init__(
        self, tokenizer: Any, script: Script, eos_id: int, *, logprob: float = -0.5, delay: float = 0.0
    ) -> None:
        self.tokenizer = tokenizer
        self.script = script
        self.eos_id = int(eos_id)
        self.logprob = logprob
        self.delay = delay
        self.calls = 0
        self.asleep = False
        self.weights: dict[str, Any] = {}

    def reply_ids(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False)) + [self.eos_id]

    async def release_session(self, session: str) -> None:
        """Nothing is cached per session here (the contract allows that)."""

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, *, session: str | None = None,
                       on_token: Callable[[int, float], None] | None = None) -> GenerateOutput:  # fmt: skip
        """With `on_token`, the tokens are handed out one by one, `delay` spread evenly over them."""
        if self.asleep:
            raise RuntimeError("ScriptedEngine.generate() called while asleep")
        self.calls += 1
        if self.delay and on_token is None:
            await asyncio.sleep(self.delay)
        out = self._cut(self.reply_ids(self.script(list(prompt_ids), sampling)), sampling)
        if on_token is not None:
            for t, lp in zip(out.token_ids, out.logprobs):
                await asyncio.sleep(self.delay / len(out.token_ids))
                on_token(t, lp)
        return out

    def _cut(self, ids: list[int], sampling: SamplingParams) -> GenerateOutput:
        stops = set(sampling.stop_token_ids) | {self.eos_id}
        for i, t in enumerate(ids):
            if t in stops and i < sampling.max_new_tokens:
                ids = ids[: i + 1]
                return GenerateOutput(ids, [self.logprob] * len(ids), "stop")
        ids = ids[: sampling.max_new_tokens]
        return GenerateOutput(ids, [self.logprob] * len(ids), "length")

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        self.weights.update(dict(named_tensors))

    async def sleep(self, discard_weights: bool = False) -> None:
        if discard_weights:
            self.weights.clear()
        self.asleep = True

    async def wake_up(self) -> None:
        self.asleep = False

    async def close(self) -> None:
        self.asleep = True
