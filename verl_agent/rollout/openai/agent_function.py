"""Train an agent you already have: an async function that talks to an OpenAI-compatible endpoint.

The contract (named in config as ``actor_rollout_ref.rollout.agent.entrypoint: module:function``
or ``path/to/file.py:function``)::

    async def run_agent(sample: dict, base_url: str, api_key: str) -> float | dict | None

`sample` is a plain dict: ``uid``, ``messages`` (OpenAI dicts), ``ground_truth``, ``data_source``,
``extra_info``, ``tools_kwargs``, ``interaction_kwargs``. If the function also takes ``model``, it is
given the served model name. Point any OpenAI client at ``base_url`` with ``api_key``; every call
is recorded token-exactly (`verl_agent.rollout.openai.recorder`). The return value scores the run: a
number, a dict with ``"reward"`` (its other numeric entries become ``agent/<key>`` metrics), or None
to let the reward function (data.reward_fn) score the text of the last model reply; as in the native
loop, ``extra_info["assistant_turns"]`` holds the text of every reply and a per-turn list scores each turn.

`AgentFunctionLoop` has the interface of `AgentLoop` (``policy_version``, ``reward_fn``,
``async run(samples, n, sampling) -> RolloutBatch``): every sample x n runs concurrently
(at most ``agent.max_concurrency`` at once), each with its own session and seed.

Segments: a run whose calls rewrite history yields one trajectory per segment, all with the
sample's uid (so GRPO groups stay whole) and the run's reward; `metrics["segment"]` numbers them.

Outcome: an exception, timeout or 5xx that comes from our endpoint or engine is an
infrastructure failure (never reward). An exception raised by the agent itself is a policy
failure with cause "agent_error" and reward 0. "budget_exhausted" (as in the native loop) when
the endpoint refused a call for lack of token budget, a reply hit the length limit, or the agent
ended the run right after the model asked for tools (stop reason "max_assistant_turns").
A client-side transport error (connection refused or dropped, a client timeout: the agent could
not reach our endpoint) is an infrastructure failure "endpoint_unreachable". A run that makes no
call is an infrastructure failure "agent_no_calls" (nothing to train on). A timeout (agent.timeout) is an
infrastructure failure "agent_timeout": a hung agent is usually waiting on something outside
the model.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from verl_agent.engine.contract import Engine, SamplingParams
from verl_agent.imports import import_object
from verl_agent.protocol import SUCCESS_THRESHOLD, RolloutBatch, Sample, Trajectory
from verl_agent.reward import RewardFunction
from verl_agent.rollout.agent_loop import InfraFailure, score_with_reward_fn
from verl_agent.rollout.openai.openai_server import OpenAIServer
from verl_agent.rollout.openai.recorder import SessionRecorder

if TYPE_CHECKING:
    from verl_agent.config import RolloutConfig

logger = logging.getLogger(__name__)

__all__ = ["AgentFunctionLoop", "load_entrypoint"]

_BUDGET = ("response_budget", "engine_length", "max_assistant_turns")


def load_entrypoint(spec: str) -> Callable[..., Any]:
    """'module:function', 'module.function' or 'path/file.py:function' -> an async function."""
    try:
        fn = import_object(spec)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"actor_rollout_ref.rollout.agent.entrypoint={spec!r}: {e}") from e
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"actor_rollout_ref.rollout.agent.entrypoint={spec!r} must name an async function")
    return fn


# Client-side failures to reach or hear back from the endpoint (httpx / openai class names, without importing them)
_TRANSPORT = {"APIConnectionError", "APITimeoutError", "ConnectError", "ConnectTimeout", "ReadTimeout", "WriteTimeout",
              "PoolTimeout", "ReadError", "WriteError", "RemoteProtocolError", "LocalProtocolError"}  # fmt: skip


def _transport_error(e: BaseException | None) -> bool:
    """Did the agent fail because it could not talk to our endpoint (an infrastructure failure)?"""
    seen = 0
    while e is not None and seen < 10:
        if isinstance(e, (ConnectionError, TimeoutError)) or type(e).__name__ in _TRANSPORT:
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def sample_dict(sample: Sample) -> dict[str, Any]:
    return {"uid": sample.uid, "messages": [m.to_chat() for m in sample.messages],
            "ground_truth": sample.ground_truth, "data_source": sample.data_source,
            "extra_info": dict(sample.extra_info), "tools_kwargs": dict(sample.tools_kwargs),
            "interaction_kwargs": dict(sample.interaction_kwargs)}  # fmt: skip


class AgentFunctionLoop:
    """Runs a user's agent function per sample x n through the recording endpoint; see the module docstring."""

    def __init__(self, engine: Engine, tokenizer: Any, rollout_cfg: RolloutConfig,
                 entrypoint: str | Callable[..., Any], reward_fn: RewardFunction | None = None,
                 max_prompt_length: int = 512, max_response_length: int = 256) -> None:  # fmt: skip
        from verl_agent.parsers import get_parser

        a = rollout_cfg.agent
        self.engine, self.tokenizer, self.cfg = engine, tokenizer, a
        self.fn = load_entrypoint(entrypoint) if isinstance(entrypoint, str) else entrypoint
        self.reward_fn = reward_fn
        self.server = OpenAIServer(
            engine, tokenizer, get_parser(rollout_cfg.multi_turn.format, tokenizer), model_names=(a.model_name,),
            host=a.host, max_request_bytes=a.max_request_bytes, use_request_sampling=a.use_request_sampling,
            max_prompt_length=max_prompt_length, max_response_length=max_response_length,
        )  # fmt: skip
        self._takes_model = "model" in inspect.signature(self.fn).parameters
        for name in ("httpx", "httpx2"):  # HTTP clients log every request at INFO: thousands of lines per step
            if logging.getLogger(name).level == logging.NOTSET:
                logging.getLogger(name).setLevel(logging.WARNING)
        self.counts: Counter[str] = Counter()  # proxy/<name>, cumulative over runs
        self._loop: Any = None
        self._users = 0
        self._lock: Any = None

    @property
    def policy_version(self) -> int:
        """The weights' version; the trainer sets it after each weight swap, and every recorded turn carries it."""
        return self.server.policy_version

    @policy_version.setter
    def policy_version(self, version: int) -> None:
        self.server.policy_version = version

    def metrics(self) -> dict[str, float]:
        return {f"proxy/{k}": float(v) for k, v in sorted(self.counts.items())}

    async def run(self, samples: list[Sample], n: int, sampling: SamplingParams) -> RolloutBatch:
        """n runs per sample, all concurrently, in sample order (segments of a run stay together)."""
        if n < 1:
            raise ValueError(f"AgentFunctionLoop.run: n must be >= 1, got {n}")
        limit = asyncio.Semaphore(self.cfg.max_concurrency or len(samples) * n or 1)
        await self._serve()
        try:
            jobs = []
            for i, sample in enumerate(samples):
                for k in range(n):
                    sp = sampling if sampling.seed is None else replace(sampling, seed=sampling.seed + i * n + k)
                    jobs.append(self._limited(limit, sample, sp))
            runs = await asyncio.gather(*jobs)
        finally:
            await self._unserve()
        return RolloutBatch(trajectories=[t for run in runs for t in run])

    async def _serve(self) -> None:
        """Start the endpoint for the first of the concurrent `run` calls (the trainer's rollout stream
        overlaps them); the last one to finish stops it."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # a new event loop (asyncio.run per call): the old server died with its loop
            self._loop, self._users, self._lock = loop, 0, asyncio.Lock()
        async with self._lock:
            if self._users == 0:
                await self.server.start()
            self._users += 1

    async def _unserve(self) -> None:
        async with self._lock:
            self._users -= 1
            if self._users == 0:
                await self.server.stop()

    async def _limited(self, limit: asyncio.Semaphore, sample: Sample, sp: SamplingParams) -> list[Trajectory]:
        async with limit:
            return await self.run_one(sample, sp)

    async def run_one(self, sample: Sample, sampling: SamplingParams) -> list[Trajectory]:
        """One agent run -> its segments as trajectories (at least one); never raises for a failure."""
        start = time.perf_counter()
        rec = self.server.open_session(sampling, uid=sample.uid)
        kw = {"model": self.cfg.model_name} if self._takes_model else {}
        result, agent_error = None, None
        try:
            coro = self.fn(sample_dict(sample), self.server.base_url(rec.sid), rec.sid, **kw)
            result = await asyncio.wait_for(coro, self.cfg.timeout)
        except asyncio.TimeoutError:
            rec.infra = rec.infra or ("agent_timeout", f"the agent ran over agent.timeout={self.cfg.timeout} s")
        except Exception as e:  # the agent's own failure, unless our endpoint failed first (rec.infra)
            agent_error = f"{type(e).__name__}: {e}"
            if rec.infra is None and _transport_error(e):
                rec.infra = ("endpoint_unreachable", agent_error)
            logger.info("agent run for %s raised: %s", sample.uid, agent_error)
        finally:
            await self.server.close_session(rec.sid)
        trajs = await self._trajectories(rec, sample, result, agent_error)
        for t in trajs:
            t.metrics["seconds"] = time.perf_counter() - start
            t.check()
        self.counts.update(rec.counts)
        return trajs

    async def _trajectories(self, rec: SessionRecorder, sample: Sample, result: Any, agent_error: str | None
                            ) -> list[Trajectory]:  # fmt: skip
        segs = [s.traj for s in rec.segments]
        if not segs:
            segs = [Trajectory(uid=sample.uid, prompt_ids=[], response_ids=[], loss_mask=[], rollout_logprobs=[],
                               policy_version=self.policy_version)]  # fmt: skip
        for i, t in enumerate(segs):
            t.data_source, t.stop_reason = sample.data_source, "end_of_turn"
            t.metrics.update(segment=float(i), num_segments=float(len(segs)), num_turns=float(len(t.turns)),
                             response_length=float(len(t.response_ids)), num_model_tokens=float(t.num_model_tokens),
                             num_tool_calls=float(rec.counts["tool_calls"]) if i == len(segs) - 1 else 0.0,
                             **{f"proxy/{k}": float(v) for k, v in rec.counts.items()})  # fmt: skip
        last = segs[-1]
        if rec.stop_reason is None and rec.segments and rec.segments[-1].history[-1].tool_calls:
            rec.stop_reason = "max_assistant_turns"  # the agent ended the run while the model still called tools
        last.stop_reason = rec.stop_reason or "end_of_turn"  # type: ignore[assignment]
        if rec.infra is None and not rec.segments:
            rec.infra = ("agent_no_calls", agent_error or "the agent made no successful model call")
        if rec.infra is None:
            try:
                reward, extra = await self._score(result if agent_error is None else 0.0, rec, sample)
            except InfraFailure as e:  # a failed reward function or a per-turn list of the wrong length
                rec.infra = (e.cause, str(e))
            except Exception as e:  # a reward function that raises is ours to report, never reward
                rec.infra = ("reward_error", f"{type(e).__name__}: {e}")
        if rec.infra is not None:
            cause, msg = rec.infra
            for t in segs:
                t.outcome, t.cause, t.error, t.reward, t.stop_reason = "infra_failure", cause, msg, 0.0, "error"
            return segs
        for t in segs:
            t.reward = reward
            t.metrics.update(extra)
            t.outcome, t.cause = self._classify(reward, rec, agent_error)
        if agent_error:
            last.error = agent_error
        return segs

    @staticmethod
    def _classify(reward: float, rec: SessionRecorder, agent_error: str | None) -> tuple[str, str | None]:
        if reward >= SUCCESS_THRESHOLD:
            return "ok", None
        if rec.stop_reason in _BUDGET:
            return "policy_failure", "budget_exhausted"
        if agent_error:
            return "policy_failure", "agent_error"
        if rec.counts["malformed_calls"]:
            return "policy_failure", "malformed_tool_call"
        return "policy_failure", "wrong_answer"

    async def _score(self, result: Any, rec: SessionRecorder, sample: Sample) -> tuple[float, dict[str, float]]:
        """(reward, agent/<key> metrics) from the agent's return value, else from reward_fn."""
        extra: dict[str, float] = {}
        if isinstance(result, dict):
            extra = {f"agent/{k}": float(v) for k, v in result.items()
                     if k != "reward" and isinstance(v, (int, float)) and not isinstance(v, bool)}  # fmt: skip
            result = result.get("reward")
        if result is not None:
            if isinstance(result, bool) or not isinstance(result, (int, float)):
                raise TypeError(f"the agent returned {type(result).__name__}; expected a number, a dict or None")
            return float(result), extra
        if self.reward_fn is None:
            return 0.0, extra
        # as the native loop: every segment's turns, in order, are the run's assistant turns
        segs = [s.traj for s in rec.segments]
        return await score_with_reward_fn(self.reward_fn, self.tokenizer, sample, segs,
                                          rec.segments[-1].last_text), extra
