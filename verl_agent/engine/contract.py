"""The `Engine` contract: async, token-in / token-out generation.

An engine turns prompt token ids into generated token ids. It never sees text,
so what it returns is exactly what the trainer trains on.

Contract (what is called when):

- ``await generate(prompt_ids, sampling) -> GenerateOutput`` may be called by
  many asyncio tasks at once (one per trajectory). Each call gets the result of
  its own request, never another's. ``token_ids`` are the sampled ids in
  order; if generation stopped on a stop id (``sampling.stop_token_ids`` or the
  model's eos) that id is the LAST element of ``token_ids`` and
  ``finish_reason == "stop"``. ``finish_reason == "length"`` means
  ``max_new_tokens`` (or the engine's context limit) was reached; ``"abort"``
  means the engine gave up on the request (shutdown, weight update in flight).
  ``logprobs[i]`` is the log-probability of ``token_ids[i]`` under the
  sampling distribution after temperature scaling and BEFORE top-k/top-p
  filtering (i.e. ``log_softmax(logits / temperature)``; for temperature 0,
  greedy, ``log_softmax(logits)``). ``len(logprobs) == len(token_ids)``.
- ``generate(..., session=sid)`` names the conversation the request belongs
  to (the agent loop passes the trajectory id). It is a hint for reusing the
  KV cache of the session's previous turn; it never changes the result: the
  same request gives the same tokens (same seed) and log-probs with or without
  it. An engine may ignore it (SGLang's radix cache finds shared prefixes by
  itself). Requests of one session are issued one at a time.
- ``generate(..., on_token=fn)`` (optional; an engine that has it names
  ``on_token`` in its signature): ``fn(token_id, logprob)`` is called on the
  caller's event loop for every sampled token, in order, as soon as the engine
  has it and before ``generate`` returns; the returned output is unchanged.
  The OpenAI endpoint streams replies with it.
- ``await release_session(sid)`` says the conversation has ended; the engine
  may free what it kept for it. Releasing an unknown session is a no-op.
- ``await interrupt() -> bool`` (optional): every generate call in flight
  returns at its next token boundary with the tokens sampled so far and
  ``finish_reason == "abort"`` (a weight update is coming; `PausableEngine`
  continues them afterwards). False: this engine cannot, callers must wait.
- ``metrics()`` (optional) returns a flat dict of ``engine/<name>`` floats,
  cumulative since the engine started (e.g. ``engine/prefill_tokens_saved``),
  except the names in ``ENGINE_GAUGES``, which are current values (slots, graphs held).
  The trainer logs the change of each counter over a step.
- ``await update_weights(named_tensors)`` replaces parameters by name; it is
  called between rollout steps, never concurrently with ``generate``.
  Unknown names are an error.
- ``await sleep()`` frees device memory (weights and KV cache) so that
  training can use the device; ``await wake_up()`` restores it. ``generate``
  is only called while awake. ``sleep(discard_weights=True)``: the caller
  will load every parameter with ``update_weights`` after ``wake_up()``, so
  the weights need not be kept (nothing is copied to the host).
- ``await close()`` releases everything; the engine is unusable afterwards.

`check_engine(engine)` runs these rules against any implementation.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    from torch import Tensor

FinishReason = Literal["stop", "length", "abort"]
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort")
# `metrics()` names that are current values, not cumulative counters
ENGINE_GAUGES = frozenset(
    {"engine/kv_slots", "engine/kv_tokens_per_slot", "engine/cuda_graphs", "engine/sessions_idle",
     "engine/compile_cache_loaded"}
)


def counter_changes(before: dict[str, float], now: dict[str, float]) -> dict[str, float]:
    """Each counter's change from `before` to `now` (two `metrics()` results); gauges as they are now."""
    return {k: v if k in ENGINE_GAUGES else v - before.get(k, 0.0) for k, v in now.items()}


@dataclass
class SamplingParams:
    """Per-request sampling settings. temperature 0 means greedy; top_k <= 0 means no top-k."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 256
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def for_turn(self, turn: int) -> SamplingParams:
        """The settings of a trajectory's call number ``turn`` (0, 1, ...): a seeded trajectory gets a seed per
        turn (turn 0 keeps the trajectory's own), so its turns draw independent noise. One seed for every
        turn would replay the same random numbers each turn: a policy near-uniform over a few answers would
        repeat its first answer, and a trajectory's turns would be lucky or unlucky together."""
        if self.seed is None or turn == 0:
            return self
        return replace(self, seed=turn_seed(self.seed, turn))


def turn_seed(seed: int, turn: int) -> int:
    """A 63-bit seed for (seed, turn), scrambled (splitmix64's finaliser) so that it does not collide with the
    neighbouring trajectories' seeds (seed + 1, ...) as seed + turn would."""
    z = (seed * 0x9E3779B97F4A7C15 + turn * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) >> 1


@dataclass
class GenerateOutput:
    """The result of one request: sampled ids, their log-probs, and why generation ended."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    versions: list[int] | None = None  # policy version per token: set by PausableEngine (rollout/stream.py)


@runtime_checkable
class Engine(Protocol):
    """Async token-in/token-out inference engine; see the module docstring for the contract."""

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, *, session: str | None = None
    ) -> GenerateOutput: ...

    async def release_session(self, session: str) -> None: ...

    async def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> None: ...

    async def sleep(self, discard_weights: bool = False) -> None: ...

    async def wake_up(self) -> None: ...

    async def close(self) -> None: ...


class EngineContractError(AssertionError):
    """An engine broke the `Engine` contract; the message says which rule."""


def check_output(out: object, sampling: SamplingParams, where: str = "generate") -> None:
    """Check one `GenerateOutput` against the contract; raises `EngineContractError`."""
    if not isinstance(out, GenerateOutput):
        raise EngineContractError(f"{where}: expected GenerateOutput, got {type(out).__name__}")
    if out.finish_reason not in FINISH_REASONS:
        raise EngineContractError(f"{where}: finish_reason {out.finish_reason!r} not in {FINISH_REASONS}")
    if len(out.logprobs) != len(out.token_ids):
        raise EngineContractError(f"{where}: {len(out.logprobs)} logprobs for {len(out.token_ids)} tokens")
    if len(out.token_ids) > sampling.max_new_tokens:
        raise EngineContractError(f"{where}: {len(out.token_ids)} tokens > max_new_tokens={sampling.max_new_tokens}")
    if not all(isinstance(t, int) for t in out.token_ids):
        raise EngineContractError(f"{where}: token_ids must be python ints")
    if any(lp > 1e-4 or lp != lp for lp in out.logprobs):
        raise EngineContractError(f"{where}: logprobs must be finite and <= 0, got {out.logprobs[:8]}...")
    stops = set(sampling.stop_token_ids)
    for i, t in enumerate(out.token_ids[:-1]):
        if t in stops:
            raise EngineContractError(f"{where}: stop id {t} at position {i} is not the last token")
    if out.finish_reason == "length" and out.token_ids and out.token_ids[-1] in stops:
        raise EngineContractError(f"{where}: ended on stop id {out.token_ids[-1]} but finish_reason='length'")


async def check_engine(engine: Engine, prompts: list[list[int]] | None = None, max_new_tokens: int = 8) -> None:
    """Run the `Engine` contract against `engine`; raises `EngineContractError` on the first violation.

    Checks: output shapes and types; concurrent requests each get their own
    answer (greedy concurrent == greedy one by one); the same seed gives the
    same sample; stop ids end generation; a session id changes no result
    (extending and non-extending later turns); releasing sessions, even unknown
    ones, works; sleep()/wake_up() keep results.
    Use small prompts of valid token ids for the engine's model.
    """
    for name in ("generate", "release_session", "update_weights", "sleep", "wake_up", "close"):
        if not inspect.iscoroutinefunction(getattr(engine, name, None)):
            raise EngineContractError(f"engine.{name} must be an async method")
    if "session" not in inspect.signature(engine.generate).parameters:
        raise EngineContractError("engine.generate must accept the keyword argument `session`")
    prompts = prompts or [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11, 12, 13]]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    alone = [await engine.generate(p, greedy) for p in prompts]
    for i, out in enumerate(alone):
        check_output(out, greedy, f"generate(prompts[{i}], greedy)")
    together = await asyncio.gather(*(engine.generate(p, greedy) for p in prompts))
    for i, (a, b) in enumerate(zip(alone, together)):
        if a.token_ids != b.token_ids:
            raise EngineContractError(
                f"prompt {i}: concurrent greedy result {b.token_ids} differs from the one-by-one result {a.token_ids}"
            )
    await _check_seed_and_stop(engine, prompts[0], alone[0], max_new_tokens)
    await _check_sessions(engine, prompts, alone, greedy)
    await engine.sleep()
    await engine.wake_up()
    again = await engine.generate(prompts[0], greedy)
    if again.token_ids != alone[0].token_ids:
        raise EngineContractError("greedy result changed after sleep()/wake_up()")


async def _check_sessions(
    engine: Engine, prompts: list[list[int]], alone: list[GenerateOutput], greedy: SamplingParams
) -> None:
    """A session id never changes results: a second turn that extends the first, and one that does not."""
    for i, (p, ref) in enumerate(zip(prompts, alone)):
        first = await engine.generate(p, greedy, session=f"check-{i}")
        if first.token_ids != ref.token_ids:
            raise EngineContractError(f"prompt {i}: with a session {first.token_ids}, without {ref.token_ids}")
        turn2 = p + first.token_ids + prompts[(i + 1) % len(prompts)]
        fresh = await engine.generate(turn2, greedy)
        for prompt, want in ((turn2, fresh), (prompts[(i + 2) % len(prompts)], None)):
            got = await engine.generate(prompt, greedy, session=f"check-{i}")
            want = want or await engine.generate(prompt, greedy)
            if got.token_ids != want.token_ids:
                raise EngineContractError(
                    f"session check-{i}: a later turn gave {got.token_ids} with the session, {want.token_ids} without"
                )
        await engine.release_session(f"check-{i}")
    await engine.release_session("never-used")


async def _check_seed_and_stop(engine: Engine, prompt: list[int], ref: GenerateOutput, n: int) -> None:
    seeded = SamplingParams(temperature=1.0, max_new_tokens=n, seed=1234)
    a, b = await asyncio.gather(engine.generate(prompt, seeded), engine.generate(prompt, seeded))
    check_output(a, seeded, "generate(seeded)")
    if a.token_ids != b.token_ids:
        raise EngineContractError(f"same seed gave different samples: {a.token_ids} vs {b.token_ids}")
    if len(ref.token_ids) >= 2:
        stop_at = ref.token_ids[1]
        stop = SamplingParams(temperature=0.0, max_new_tokens=n, stop_token_ids=[stop_at])
        out = await engine.generate(prompt, stop)
        check_output(out, stop, "generate(stop_token_ids)")
        first = ref.token_ids.index(stop_at)
        if out.token_ids != ref.token_ids[: first + 1] or out.finish_reason != "stop":
            raise EngineContractError(
                f"stop id {stop_at}: expected {ref.token_ids[: first + 1]} with 'stop', "
                f"got {out.token_ids} with {out.finish_reason!r}"
            )
