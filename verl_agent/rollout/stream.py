"""A continuous rollout stream: samples go in, finished GRPO groups come out, weights change between turns.

    stream = RolloutStream(agent)                  # agent.engine is wrapped in a PausableEngine
    stream.feed(samples, n, sampling, batch=7)     # starts one task per sample (its n trajectories)
    groups, stale = await stream.take(k, min_version=v)
    await stream.pause(drain=False)                # no generate call in flight from here on
    ... update the engine's weights, agent.policy_version += 1 ...
    stream.resume()

Groups are handed out in the order they finish (the trainer takes batches as they fill), then
sorted by (batch, position) so that a window of one batch gives exactly what a synchronous
rollout of that batch gives. A group whose oldest token is older than `min_version` is dropped
(counted) and its sample is fed again from scratch, so nothing is lost.

Weight updates never race a forward pass: `pause()` closes the engine's gate (new generate calls
wait), interrupts the calls in flight at a token boundary where the engine can (`Engine.interrupt`,
the `hf` engine's continuous scheduler), else waits for them to return, i.e. for the turn boundary.
An interrupted call continues under the new weights once the gate opens (partial rollout): the
caller gets one output whose `versions` name the policy of every token. `pause(drain=True)` instead
lets every started trajectory finish under the old weights first and holds new ones back.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from verl_agent.protocol import Sample, Trajectory
from verl_agent.engine.contract import GenerateOutput, SamplingParams

logger = logging.getLogger(__name__)

__all__ = ["Group", "PausableEngine", "RolloutStream"]


class PausableEngine:
    """Wraps an Engine: generate calls pass a gate, and `pause()` returns once none is in flight.

    Sessions pass through to engines that take them (and are dropped for those that do not),
    so the wrapper is transparent to agent loops and to the OpenAI endpoint. Every output carries
    per-token `versions` (`version_of()` when the tokens were generated).
    """

    def __init__(self, engine: Any, version_of: Callable[[], int] = lambda: 0) -> None:
        self.engine = engine
        self.version_of = version_of
        params = inspect.signature(engine.generate).parameters
        self._sessions, self._streams = "session" in params, "on_token" in params
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._inflight = 0
        self._interrupts = 0  # pauses that interrupted the calls in flight
        self.continued = 0  # generate calls resumed under new weights after an interrupt

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, *, session: str | None = None,
                       on_token: Callable[[int, float], None] | None = None) -> GenerateOutput:  # fmt: skip
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        while True:
            while not self._open.is_set():
                await self._open.wait()
            epoch, version = self._interrupts, self.version_of()
            sp = sampling
            if tokens:  # the rest of an interrupted call; its own seed, so a rerun samples the same
                seed = None if sampling.seed is None else sampling.seed + len(tokens)
                sp = replace(sampling, max_new_tokens=sampling.max_new_tokens - len(tokens), seed=seed)
            out = await self._generate_once(prompt_ids + tokens, sp, session, on_token)
            tokens += out.token_ids
            logprobs += out.logprobs
            versions += [version] * len(out.token_ids)
            interrupted = out.finish_reason == "abort" and self._interrupts != epoch
            if not interrupted or len(tokens) >= sampling.max_new_tokens:
                reason = out.finish_reason if not interrupted else "length"
                return GenerateOutput(tokens, logprobs, reason, versions=versions)
            self.continued += 1

    async def _generate_once(self, prompt_ids: list[int], sampling: SamplingParams, session: str | None,
                             on_token: Callable[[int, float], None] | None) -> GenerateOutput:  # fmt: skip
        kw: dict[str, Any] = {"session": session} if self._sessions and session is not None else {}
        if on_token is not None and self._streams:
            kw["on_token"] = on_token
        self._inflight += 1
        self._idle.clear()
        try:
            return await self.engine.generate(prompt_ids, sampling, **kw)
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.set()

    async def release_session(self, session: str) -> None:
        release = getattr(self.engine, "release_session", None)
        if self._sessions and release is not None:
            await release(session)

    async def pause(self, interrupt: bool = False) -> bool:
        """Close the gate and return once no call is in flight. `interrupt`: end the calls in flight at a
        token boundary (they continue after `resume()`) where the engine can; returns whether it did."""
        self._open.clear()
        interrupted = False
        if interrupt and self._inflight and hasattr(self.engine, "interrupt"):
            self._interrupts += 1
            interrupted = bool(await self.engine.interrupt())
        await self._idle.wait()
        return interrupted

    def resume(self) -> None:
        self._open.set()

    def __getattr__(self, name: str) -> Any:  # update_weights, sleep, wake_up, close, metrics, start...
        return getattr(self.engine, name)


@dataclass
class Group:
    """The n trajectories of one sample."""

    batch: int
    position: int
    sample: Sample
    trajectories: list[Trajectory]
    sampling: SamplingParams
    started_at: int = 0
    n: int = 0  # runs fed; a run whose context was rewritten gives several trajectories (its segments)

    @property
    def oldest_version(self) -> int:
        return min(t.oldest_version for t in self.trajectories)


@dataclass
class _Fed:
    batch: int
    position: int
    sample: Sample
    n: int
    sampling: SamplingParams
    started_at: int = 0  # the policy version when its rollout started


class RolloutStream:
    """See the module docstring. All methods run on the event loop that owns the agent's engine."""

    def __init__(self, agent: Any) -> None:
        self.agent = agent
        if not isinstance(agent.engine, PausableEngine):  # build_rollout wraps it already; tests may not
            agent.engine = PausableEngine(agent.engine)
        self.engine: PausableEngine = agent.engine
        self.engine.version_of = lambda: agent.policy_version
        self.ready: list[Group] = []
        self.running: dict[asyncio.Task, _Fed] = {}
        self.held: list[_Fed] = []  # fed while draining: started on resume()
        self._draining = False
        self._changed = asyncio.Event()
        self.dropped_stale = 0

    def feed(self, samples: list[Sample], n: int, sampling: SamplingParams, batch: int) -> None:
        """Start n trajectories per sample; sample i's seeds are sampling.seed + i*n + k, as in AgentLoop.run."""
        for i, sample in enumerate(samples):
            sp = sampling if sampling.seed is None else replace(sampling, seed=sampling.seed + i * n)
            self._start(_Fed(batch, i, sample, n, sp))

    def _start(self, fed: _Fed) -> None:
        if self._draining:
            self.held.append(fed)
            return
        fed.started_at = self.agent.policy_version
        task = asyncio.get_running_loop().create_task(self.agent.run([fed.sample], fed.n, fed.sampling))
        self.running[task] = fed
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task) -> None:
        fed = self.running.pop(task)
        if task.cancelled():
            return
        if task.exception() is not None:  # AgentLoop.run never raises for a trajectory; this is a bug
            logger.error("rollout of %s raised: %r", fed.sample.uid, task.exception())
            # stamped with the version it started under: with none generated, it is as fresh as its start, so
            # take() counts the infra failure instead of calling it stale (or a loop that forgot the version)
            trajs = [Trajectory(uid=fed.sample.uid, prompt_ids=[], response_ids=[], loss_mask=[], rollout_logprobs=[],
                                stop_reason="error", outcome="infra_failure", cause="agent_loop_error",
                                error=repr(task.exception()), data_source=fed.sample.data_source,
                                policy_version=fed.started_at) for _ in range(fed.n)]  # fmt: skip
        else:
            trajs = task.result().trajectories
        self.ready.append(Group(fed.batch, fed.position, fed.sample, trajs, fed.sampling, fed.started_at, fed.n))
        self._changed.set()

    @property
    def pending(self) -> int:
        """Groups fed but not yet taken."""
        return len(self.ready) + len(self.running) + len(self.held)

    async def take(self, k: int, min_version: int) -> tuple[list[Group], int]:
        """The first k groups to finish whose oldest token is at least `min_version` (fewer if fewer are pending).

        Stale groups are dropped, counted and fed again. Returns (groups sorted by (batch, position), dropped).
        """
        out: list[Group] = []
        dropped = 0
        while len(out) < k and (self.ready or self.running or self.held):
            if not self.ready:
                self._changed.clear()
                await self._changed.wait()
                continue
            group = self.ready.pop(0)
            if group.oldest_version < min_version:
                if group.started_at >= min_version:  # rolling it out again would loop forever
                    raise RuntimeError(
                        f"{type(self.agent).__name__} recorded policy version {group.oldest_version} on a rollout "
                        f"started under version {group.started_at}: set Turn.policy_version from the loop's "
                        "policy_version when a generation returns")
                dropped += 1
                self.dropped_stale += 1
                self._start(_Fed(group.batch, group.position, group.sample, group.n or len(group.trajectories),
                                 group.sampling))
                continue
            out.append(group)
        out.sort(key=lambda g: (g.batch, g.position))
        return out, dropped

    async def pause(self, drain: bool = False) -> None:
        """Stop generation at a token boundary (a turn boundary on engines that cannot interrupt) or, with
        drain, once every started trajectory has finished."""
        if drain:
            self._draining = True
            while self.running:
                self._changed.clear()
                await self._changed.wait()
        await self.engine.pause(interrupt=not drain)

    def resume(self) -> None:
        self.engine.resume()
        self._draining = False
        held, self.held = self.held, []
        for fed in held:
            self._start(fed)

    async def cancel(self) -> list[Sample]:
        """Stop everything; return the samples fed but not taken (a checkpoint re-feeds them)."""
        samples = [g.sample for g in self.ready] + [f.sample for f in self.running.values()] + [f.sample for f in self.held]
        tasks = list(self.running)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.ready, self.held = [], []
        return samples
