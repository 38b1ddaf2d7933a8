"""`ChatAPILoop`: the multi-turn tool loop against any OpenAI-compatible Chat Completions server.

For evaluating a model served elsewhere (vLLM, SGLang, our own endpoint, a hosted API): the config's
tools run here exactly as in the native loop (`ToolSession`, `run_tool_calls`), the same reward
function scores the final reply, and outcomes and causes follow the same rules (`agent_loop.classify`).
The server sees the messages and the tools' schemas; there are no token ids, so the trajectories carry
messages only (not trainable). It has the interface of `AgentLoop`: ``run(samples, n, sampling)``.

Per turn: ``POST {base_url}/chat/completions`` with messages, tools, temperature, top_p, max_tokens
(what is left of data.max_response_length, counted in completion tokens: the server does not say how
many tokens an observation takes before the call) and the native loop's seed of that sample and turn.
A reply with tool calls runs them and loops, up to multi_turn.max_assistant_turns; a reply without ends
the episode. A call whose arguments are not JSON is a malformed call (the model's failure). The server
being unreachable, timing out, answering 5xx / 429 / another error or something that is not a chat
completion is an infrastructure failure with cause "endpoint_error", never a reward; a 400 for an
over-long context ends the episode as "response_budget" (the model's budget is spent).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from verl_agent.engine.contract import SamplingParams
from verl_agent.protocol import Message, RolloutBatch, Sample, ToolCall, Trajectory, Turn
from verl_agent.reward import RewardFunction, default_scorer
from verl_agent.rollout.agent_loop import InfraFailure, classify, score_with_reward_fn
from verl_agent.rollout.observations import run_tool_calls

if TYPE_CHECKING:
    from verl_agent.config import RolloutConfig
    from verl_agent.tools.base import BaseTool

__all__ = ["ChatAPILoop", "wire_message"]

logger = logging.getLogger(__name__)


def wire_message(m: Message) -> dict[str, Any]:
    """Our message as the Chat Completions API takes it (tool-call arguments as a JSON string)."""
    out = m.to_chat()
    for call in out.get("tool_calls", []):
        call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
    return out


def _parse_calls(raw: list[dict[str, Any]]) -> tuple[list[ToolCall], list[str]]:
    """The reply's tool calls, and an error text for each one whose arguments are not a JSON object."""
    calls, errors = [], []
    for i, c in enumerate(raw):
        fn = c.get("function") or {}
        args = fn.get("arguments") or "{}"
        try:
            parsed = json.loads(args) if isinstance(args, str) else args
        except json.JSONDecodeError as e:
            errors.append(f"tool call {i} ({fn.get('name')!r}): arguments are not JSON: {e}")
            continue
        if not isinstance(parsed, dict):
            errors.append(f"tool call {i} ({fn.get('name')!r}): arguments must be a JSON object")
            continue
        calls.append(ToolCall(name=str(fn.get("name", "")), arguments=parsed, id=str(c.get("id") or f"call_{i}")))
    return calls, errors


class _Stop(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class ChatAPILoop:
    """Rollouts through an OpenAI-compatible server; see the module docstring."""

    def __init__(self, base_url: str, model: str | None, rollout_cfg: RolloutConfig, tools: dict[str, BaseTool],
                 reward_fn: RewardFunction | None = None, max_response_length: int = 256, api_key: str = "EMPTY",
                 timeout: float = 600.0, max_concurrency: int | None = None) -> None:  # fmt: skip
        self.base_url, self.model, self.api_key = base_url.rstrip("/"), model, api_key
        self.mt = rollout_cfg.multi_turn
        self.tools = dict(tools) if self.mt.enable else {}
        self.reward_fn, self.max_response_length = reward_fn, max_response_length
        self.timeout, self.max_concurrency = timeout, max_concurrency
        self.policy_version = 0

    async def served_model(self, http: Any) -> str:
        """The model to ask for: the one given, else the first the server lists."""
        if self.model is None:
            try:
                resp = await http.get(f"{self.base_url}/models")
                resp.raise_for_status()
                self.model = resp.json()["data"][0]["id"]
            except Exception as e:
                raise ConnectionError(f"{self.base_url}/models: cannot list the served models ({type(e).__name__}: "
                                      f"{e}); name one with --served-model-name") from e
        return self.model

    async def run(self, samples: list[Sample], n: int, sampling: SamplingParams) -> RolloutBatch:
        """n trajectories per sample, at most max_concurrency episodes at once (None: all), in sample order."""
        import httpx

        limit = asyncio.Semaphore(self.max_concurrency or len(samples) * n or 1)
        headers = {"Authorization": f"Bearer {self.api_key}"}
        async with httpx.AsyncClient(timeout=self.timeout, headers=headers) as http:
            await self.served_model(http)

            async def one(sample: Sample, sp: SamplingParams) -> Trajectory:
                async with limit:
                    return await self.run_one(http, sample, sp)

            jobs = [one(s, sampling if sampling.seed is None else replace(sampling, seed=sampling.seed + i * n + k))
                    for i, s in enumerate(samples) for k in range(n)]  # fmt: skip
            return RolloutBatch(trajectories=list(await asyncio.gather(*jobs)))

    async def run_one(self, http: Any, sample: Sample, sampling: SamplingParams) -> Trajectory:
        """One episode; never raises for a failure of the model, a tool or the server."""
        traj = Trajectory(uid=sample.uid, prompt_ids=[], response_ids=[], loss_mask=[], rollout_logprobs=[],
                          data_source=sample.data_source, messages=list(sample.messages))  # fmt: skip
        counts = {"tool_calls": 0.0, "tool_errors": 0.0, "malformed_calls": 0.0, "completion_tokens": 0.0}
        start = time.perf_counter()
        try:
            async with contextlib.AsyncExitStack() as stack:
                session = await self._session(sample, stack)
                try:
                    await self._turns(http, traj, session, sampling, counts)
                except _Stop as stop:
                    traj.stop_reason = stop.reason  # type: ignore[assignment]
                traj.reward = await self._reward(traj, session, sample)
        except Exception as e:  # one failing episode never stops the others
            import httpx

            cause = e.cause if isinstance(e, InfraFailure) else "endpoint_error" if isinstance(e, httpx.HTTPError) \
                else "agent_loop_error"  # fmt: skip
            if cause == "agent_loop_error":  # a bug of ours, as in the native loop
                logger.error("episode %s: %s", sample.uid, e, exc_info=True)
            traj.outcome, traj.cause, traj.error, traj.reward = "infra_failure", cause, f"{type(e).__name__}: {e}", 0.0
            traj.stop_reason = "error"
        else:
            classify(traj, counts)
        traj.metrics.update(num_turns=float(len(traj.turns)), num_tool_calls=counts["tool_calls"],
                            num_tool_errors=counts["tool_errors"], completion_tokens=counts["completion_tokens"],
                            seconds=time.perf_counter() - start)  # fmt: skip
        return traj

    async def _session(self, sample: Sample, stack: contextlib.AsyncExitStack) -> Any:
        if not self.tools:
            return None
        from verl_agent.tools import ToolSession

        return await stack.enter_async_context(ToolSession(self.tools, sample.tools_kwargs,
                                                           timeout=self.mt.tool_timeout))

    async def _turns(self, http: Any, traj: Trajectory, session: Any, sp: SamplingParams, counts: dict) -> None:
        max_turns = self.mt.max_assistant_turns if self.mt.enable else 1
        while True:
            budget = self.max_response_length - int(counts["completion_tokens"])
            if budget <= 0:
                raise _Stop("response_budget")
            t0 = time.perf_counter()
            turn_sp = sp.for_turn(len(traj.turns))  # the native loop's seed per turn
            msg, finish = await self._complete(http, traj.messages, session, turn_sp,
                                               min(budget, sp.max_new_tokens), counts)  # fmt: skip
            calls, errors = _parse_calls(msg.get("tool_calls") or [])
            traj.messages.append(Message(role="assistant", content=msg.get("content") or "", tool_calls=calls))
            turn = Turn(gen_start=0, gen_end=0, obs_end=0)
            turn.gen_seconds = time.perf_counter() - t0
            traj.turns.append(turn)
            if finish == "length":
                raise _Stop("response_budget" if counts["completion_tokens"] >= self.max_response_length
                            else "engine_length")  # fmt: skip
            if session is None or not (calls or errors):
                raise _Stop("end_of_turn")
            if max_turns is not None and len(traj.turns) >= max_turns:
                raise _Stop("max_assistant_turns")
            res = await run_tool_calls(session, calls, errors, max_parallel_calls=self.mt.max_parallel_calls,
                                       max_chars=self.mt.max_tool_response_length,
                                       truncate_side=self.mt.tool_response_truncate_side)  # fmt: skip
            turn.num_tool_calls, turn.score, turn.tool_seconds = res.num_calls, res.reward, res.seconds
            counts["tool_calls"] += res.num_calls
            counts["tool_errors"] += res.num_errors
            counts["malformed_calls"] += len(errors)
            if res.infra is not None:
                raise InfraFailure(*res.infra)
            traj.messages.extend(res.messages)
            if any(m.get("episode_done") for m in res.metrics):
                raise _Stop("end_of_turn")

    async def _complete(self, http: Any, messages: list[Message], session: Any, sp: SamplingParams, max_tokens: int,
                        counts: dict) -> tuple[dict[str, Any], str | None]:  # fmt: skip
        """One chat completion: (the reply message, its finish_reason)."""
        body: dict[str, Any] = {"model": self.model, "messages": [wire_message(m) for m in messages],
                                "temperature": sp.temperature, "top_p": sp.top_p, "max_tokens": max_tokens}
        if session is not None:
            body["tools"] = session.schemas()
        if sp.seed is not None:
            body["seed"] = sp.seed
        resp = await http.post(f"{self.base_url}/chat/completions", json=body)
        if resp.status_code == 400 and "context_length_exceeded" in resp.text:
            raise _Stop("response_budget")
        if resp.status_code != 200:
            raise InfraFailure("endpoint_error", f"{self.base_url}/chat/completions answered {resp.status_code}: "
                               f"{resp.text[:300]}")
        try:
            data = resp.json()
            choice = data["choices"][0]
            message, finish = dict(choice["message"]), choice.get("finish_reason")
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise InfraFailure("endpoint_error", f"{self.base_url}/chat/completions: not a chat completion: "
                               f"{resp.text[:300]}") from e
        counts["completion_tokens"] += float((data.get("usage") or {}).get("completion_tokens") or 0)
        return message, finish

    async def _reward(self, traj: Trajectory, session: Any, sample: Sample) -> float:
        """As the native loop: reward_fn, else the data source's scorer, else the tools' calc_reward."""
        reward_fn = self.reward_fn or default_scorer(sample.data_source)
        texts = [m.content for m in traj.messages[len(sample.messages):] if m.role == "assistant"]
        if reward_fn is not None:
            return await score_with_reward_fn(reward_fn, None, sample, [traj], texts[-1] if texts else "", texts)
        if session is not None:
            try:
                return float(await session.calc_reward())
            except RuntimeError as e:
                raise InfraFailure(getattr(e.__cause__, "cause", None) or "reward_error", str(e)) from e
        return 0.0
