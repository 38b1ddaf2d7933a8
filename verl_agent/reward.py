"""Reward functions: load a user's scorer by name and call it safely.

A spec is ``"module.func"`` (importable; the current directory is on the path) or
``"path/to/file.py:func"``. Two signatures are accepted and told apart by their parameters:

* seed style: ``fn(generated_text, ground_truth) -> float``
* verl style: ``compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float | dict``
  (a dict must carry ``"score"``; its other numeric entries are kept as info)

Either may instead return a list of numbers, one per assistant turn (the agent loop passes the turns'
texts as ``extra_info["assistant_turns"]``): they become the turns' scores and their sum the reward,
so turn-level estimators (``grpo_turn``, ``gigpo``) credit each turn with its own score. A dict's
``"score"`` may be such a list too.

A scorer that raises or returns something that is not a number never crashes the run: the sample gets
score 0.0 and `RewardResult.error` says what went wrong (the trainer counts and logs these). An exception
with a string ``cause`` attribute (e.g. `judge.JudgeError`: judge_unavailable, judge_unparsable) names
the cause it is counted under (`RewardResult.cause`; reward_error otherwise).

An ``async`` scorer is awaited on the caller's event loop by `RewardFunction.acall` (the agent loop's
way, as verl's reward loop awaits an async ``compute_score``); a plain one runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from verl_agent.imports import import_object, is_file_spec

__all__ = ["DEFAULT_SCORERS", "RewardError", "RewardFunction", "RewardResult", "default_scorer", "load_reward_fn"]


class RewardError(ValueError):
    """The reward function spec cannot be loaded (bad path, missing function, unusable signature)."""


@dataclass
class RewardResult:
    score: float
    info: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    turn_scores: list[float] | None = None  # one per assistant turn when the function returned a list
    cause: str | None = None  # the failure's cause when the scorer's exception names one (else reward_error)


def _import_callable(spec: str) -> Callable[..., Any]:
    if not is_file_spec(spec) and "." not in spec:
        raise RewardError(f"reward function spec {spec!r} must be 'module.func' or 'path/file.py:func'")
    try:
        fn = import_object(spec)
    except (ImportError, AttributeError) as e:
        raise RewardError(f"cannot load reward function {spec!r}: {e}") from e
    if not callable(fn):
        raise RewardError(f"{spec!r} names {type(fn).__name__} {fn!r:.60}, not a callable")
    return fn


_VERL_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


class RewardFunction:
    """A loaded scorer with one calling convention: keyword arguments in, `RewardResult` out."""

    def __init__(self, fn: Callable[..., Any], spec: str = "") -> None:
        self.fn, self.spec = fn, spec or getattr(fn, "__name__", repr(fn))
        params = inspect.signature(fn).parameters
        names = list(params)
        accepts_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
        required = [n for n, p in params.items() if p.default is p.empty and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]
        if "solution_str" in params or "data_source" in params:
            self.style = "verl"
            unknown = [n for n in required if n not in _VERL_ARGS]
            if unknown:
                raise RewardError(f"reward function {self.spec!r} requires {unknown}, which a scorer is not given "
                                  f"(it gets {list(_VERL_ARGS)} by name): give them defaults")
            self._args = set(_VERL_ARGS) if accepts_kwargs else set(_VERL_ARGS) & set(params)  # e.g. no extra_info
        elif len(required) <= 2:
            self.style = "seed"
        else:
            raise RewardError(
                f"reward function {self.spec!r} has parameters {names}; expected (generated_text, ground_truth) "
                "or (data_source, solution_str, ground_truth, extra_info=None)"
            )

    @property
    def is_async(self) -> bool:
        """The scorer is a coroutine function (or an object whose ``__call__`` is one)."""
        return inspect.iscoroutinefunction(self.fn) or inspect.iscoroutinefunction(getattr(self.fn, "__call__", None))

    def __call__(
        self, *, data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
    ) -> RewardResult:
        """Score one answer. Runs in a worker thread (no event loop there), so an async scorer is awaited here."""
        try:
            raw = self._invoke(data_source, solution_str, ground_truth, extra_info)
            if inspect.isawaitable(raw):
                raw = asyncio.run(_awaited(raw))
        except Exception as e:  # a user's scorer must not kill the run; the error is reported per sample
            return self._failed(e)
        return self._normalise(raw)

    async def acall(
        self, *, data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None
    ) -> RewardResult:
        """Score one answer from async code: an async scorer on this loop, a plain one in a worker thread."""
        kw = {"data_source": data_source, "solution_str": solution_str, "ground_truth": ground_truth,
              "extra_info": extra_info}
        if not self.is_async:
            return await asyncio.to_thread(self, **kw)
        try:
            raw = await self._invoke(data_source, solution_str, ground_truth, extra_info)
        except Exception as e:  # as in __call__
            return self._failed(e)
        return self._normalise(raw)

    def _invoke(self, data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None) -> Any:
        if self.style == "seed":
            return self.fn(solution_str, ground_truth)
        given = {"data_source": data_source, "solution_str": solution_str, "ground_truth": ground_truth,
                 "extra_info": extra_info or {}}
        return self.fn(**{k: v for k, v in given.items() if k in self._args})

    def _failed(self, e: Exception) -> RewardResult:
        cause = getattr(e, "cause", None)
        return RewardResult(0.0, error=f"{self.spec} raised {type(e).__name__}: {e}",
                            cause=cause if isinstance(cause, str) and cause else None)

    def _normalise(self, raw: Any) -> RewardResult:
        info: dict[str, float] = {}
        if isinstance(raw, dict):
            if "score" not in raw:
                return RewardResult(0.0, error=f"{self.spec} returned a dict without 'score': keys {sorted(raw)}")
            info = {k: float(v) for k, v in raw.items() if k != "score" and isinstance(v, (int, float))}
            raw = raw["score"]
        if isinstance(raw, (list, tuple)):
            bad = [x for x in raw if not isinstance(x, (int, float)) or not math.isfinite(float(x))]
            if bad:
                return RewardResult(0.0, info, error=f"{self.spec} returned a per-turn list with {bad[0]!r:.60}, "
                                    "not a finite number")
            return RewardResult(float(sum(raw)), info, turn_scores=[float(x) for x in raw])
        if not isinstance(raw, (int, float)) or not math.isfinite(float(raw)):  # bool counts as 0/1
            return RewardResult(0.0, info, error=f"{self.spec} returned {raw!r:.60}, not a finite number")
        return RewardResult(float(raw), info)


def load_reward_fn(spec: str | Callable[..., Any]) -> RewardFunction:
    """Load 'module.func' / 'path/file.py:func' (or wrap a callable) as a RewardFunction."""
    if callable(spec):
        return RewardFunction(spec)
    if not isinstance(spec, str) or not spec.strip():
        raise RewardError(f"reward function spec must be a non-empty string, got {spec!r}")
    return RewardFunction(_import_callable(spec.strip()), spec.strip())


# verl scores a row by its data_source when no reward function is configured; the sources we have scorers for.
DEFAULT_SCORERS: dict[str, str] = {"openai/gsm8k": "verl_agent.gsm8k.compute_score"}
_default_cache: dict[str, RewardFunction] = {}


def default_scorer(data_source: str | None) -> RewardFunction | None:
    """The built-in scorer of `data_source` (verl's default_compute_score), or None when there is none."""
    spec = DEFAULT_SCORERS.get(data_source or "")
    if spec is None:
        return None
    if spec not in _default_cache:
        _default_cache[spec] = load_reward_fn(spec)
    return _default_cache[spec]
