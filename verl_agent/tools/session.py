"""ToolSession: the tools of ONE trajectory, with per-sample kwargs, timeouts and guaranteed release.

    async with ToolSession(tools, sample.tools_kwargs, timeout=30) as session:
        encoder = ChatEncoder(tokenizer, tools=session.schemas())
        result = await session.call(tool_call)   # never raises for a bad call
        reward = await session.calc_reward()

`tools_kwargs` is the dataset row's `extra_info.tools_kwargs`:
`{tool_name: {create_kwargs, execute_kwargs, calc_reward_kwargs, release_kwargs}}`,
each passed to the matching lifecycle method of that tool. Every tool of one session is offered the
same instance id (``trajectory_id``), so tools that share per-trajectory state (the container tools of
verl_agent.tasks) find it under one key.

Failure policy: whatever goes wrong in one call becomes a `ToolResult(ok=False,
text="Error: ...")`; only cancellation propagates. What the model got wrong (unknown
tool, arguments that are not JSON or do not fit the schema) is a policy failure the
model sees next turn; so is a `ToolArgumentError` raised by `execute`. What failed on
our side (an exception inside `execute`, a timeout, `ToolUnavailable`, a `create` that
failed) also sets `ToolResult.infra` to a cause ("tool_crash", "tool_timeout",
"tool_create_failed", or the exception's cause): the agent loop ends that trajectory as
an infrastructure failure. Every created instance is released on exit, also after an
exception or cancellation (release runs shielded).

A timeout cancels the awaiting coroutine; work a tool pushed to a thread keeps
running in that thread until it finishes (Python cannot kill threads).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from verl_agent.protocol import ToolCall
from verl_agent.tools.base import BaseTool, ToolResponse
from verl_agent.tools.errors import ToolArgumentError, ToolUnavailable
from verl_agent.tools.schema import validate_arguments

__all__ = ["ToolResult", "ToolSession"]

logger = logging.getLogger(__name__)
_KWARG_KEYS = ("create_kwargs", "execute_kwargs", "calc_reward_kwargs", "release_kwargs")


@dataclass
class ToolResult:
    """Outcome of one call: `text` goes back to the model as the tool message."""

    text: str
    reward: float = 0.0
    metrics: dict[str, Any] = field(default_factory=dict)
    ok: bool = True
    name: str = ""
    seconds: float = 0.0
    image: list | None = None
    infra: str | None = None  # cause of an infrastructure failure (not the model's doing); None otherwise


def _normalise(out: Any) -> tuple[ToolResponse, float, dict[str, Any]]:
    """Accept verl-style returns: (ToolResponse | str, reward | None, metrics | None) or a bare response."""
    resp, reward, metrics = out if isinstance(out, tuple) and len(out) == 3 else (out, 0.0, {})
    if isinstance(resp, str):
        resp = ToolResponse(text=resp)
    elif not isinstance(resp, ToolResponse):
        text = getattr(resp, "text", None)
        if text is None and resp is not None:
            raise TypeError(f"execute returned {type(resp).__name__}; expected (ToolResponse, reward, metrics)")
        resp = ToolResponse(text=text or "", image=getattr(resp, "image", None))
    value = float(reward or 0.0)
    if not math.isfinite(value):  # one NaN would poison its whole group's advantages
        raise ValueError(f"execute returned a non-finite reward ({value})")
    return resp, value, dict(metrics or {})


class ToolSession:
    """Per-trajectory tool state over shared BaseTool objects; use as `async with`."""

    def __init__(self, tools: Mapping[str, BaseTool], tools_kwargs: dict | None = None, timeout: float = 30.0):
        if timeout <= 0:
            raise ValueError(f"tool timeout must be > 0 seconds, got {timeout}")
        self.tools = dict(tools)
        self.timeout = float(timeout)
        self.kwargs: dict[str, dict[str, dict[str, Any]]] = {}
        for name, kw in (tools_kwargs or {}).items():
            if not isinstance(kw, Mapping):
                raise ValueError(f"tools_kwargs[{name!r}] must be a mapping with {_KWARG_KEYS}, got {kw!r}")
            self.kwargs[name] = {k: dict(kw.get(k) or {}) for k in _KWARG_KEYS}
        self.trajectory_id = str(uuid.uuid4())
        self.instance_ids: dict[str, str] = {}
        self.create_errors: dict[str, str] = {}
        self.stats = {"tool_calls": 0.0, "tool_errors": 0.0, "tool_timeouts": 0.0}
        self.reward_metrics: dict[str, float] = {}  # from tools' optional reward_metrics(instance_id)
        self._entered = False

    def _kw(self, tool_name: str, key: str) -> dict[str, Any]:
        return dict(self.kwargs.get(tool_name, {}).get(key, {}))

    def schemas(self) -> list[dict[str, Any]]:
        """OpenAI tool schemas of every tool, for the chat template."""
        return [t.get_openai_tool_schema().to_openai() for t in self.tools.values()]

    async def __aenter__(self) -> ToolSession:
        self._entered = True
        await asyncio.gather(*(self._create(name, tool) for name, tool in self.tools.items()))
        return self

    async def _create(self, name: str, tool: BaseTool) -> None:
        wanted = self.trajectory_id  # one id for every tool of the trajectory: tools can share its state
        try:
            out = await asyncio.wait_for(tool.create(wanted, **self._kw(name, "create_kwargs")), self.timeout)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # reported to the model on each call to this tool
            self.create_errors[name] = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            logger.warning("tool %r: create failed: %s", name, self.create_errors[name])
            return
        # verl >= 0.5 returns (instance_id, ToolResponse); ours returns the id.
        iid = out[0] if isinstance(out, tuple) else out
        self.instance_ids[name] = iid if isinstance(iid, str) and iid else wanted

    async def __aexit__(self, *exc: Any) -> None:
        await asyncio.shield(self.close())

    async def close(self) -> None:
        """Release every created instance (each once, errors logged); safe to call twice."""
        ids, self.instance_ids = self.instance_ids, {}
        await asyncio.gather(*(self._release(name, iid) for name, iid in ids.items()))

    async def _release(self, name: str, iid: str) -> None:
        try:
            coro = self.tools[name].release(iid, **self._kw(name, "release_kwargs"))
            await asyncio.wait_for(coro, self.timeout)
        except Exception:
            logger.exception("tool %r: release(%s) failed", name, iid)

    async def call(self, call: ToolCall) -> ToolResult:
        """Run one tool call; every failure becomes ok=False with an "Error: ..." text."""
        self.stats["tool_calls"] += 1
        start = time.monotonic()
        result = await self._call(call)
        result.seconds = time.monotonic() - start
        result.name = call.name
        if not result.ok:
            self.stats["tool_errors"] += 1
        return result

    def _fail(self, msg: str, infra: str | None = None) -> ToolResult:
        return ToolResult(text=f"Error: {msg}", ok=False, infra=infra)

    async def _call(self, call: ToolCall) -> ToolResult:
        if not self._entered:
            raise RuntimeError("ToolSession.call() outside `async with ToolSession(...)`")
        tool = self.tools.get(call.name)
        if tool is None:
            names = ", ".join(f'"{n}"' for n in self.tools) or "none"
            return self._fail(f'unknown tool "{call.name}"; available tools: {names}')
        if call.name in self.create_errors:
            return self._fail(f'tool "{call.name}" is unavailable: {self.create_errors[call.name]}',
                              infra="tool_create_failed")
        args: Any = {} if call.arguments is None else call.arguments  # a call with no arguments at all
        if isinstance(args, str):  # a parser may hand over raw text when the model's JSON was odd
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                return self._fail(f'arguments of "{call.name}" are not valid JSON: {e.msg} at position {e.pos}')
        try:
            args = validate_arguments(tool.get_openai_tool_schema().function.parameters, args)
        except ToolArgumentError as e:
            return self._fail(str(e))
        iid = self.instance_ids[call.name]
        try:
            coro = tool.execute(iid, args, **self._kw(call.name, "execute_kwargs"))
            resp, reward, metrics = _normalise(await asyncio.wait_for(coro, self.timeout))
        except asyncio.TimeoutError:
            self.stats["tool_timeouts"] += 1
            return self._fail(f'tool "{call.name}" timed out after {self.timeout:g} s', infra="tool_timeout")
        except asyncio.CancelledError:
            raise
        except ToolArgumentError as e:  # the tool refused the arguments: the model's doing
            return self._fail(str(e))
        except ToolUnavailable as e:
            logger.warning("tool %r unavailable (%s): %s", call.name, e.cause, e)
            return self._fail(f'tool "{call.name}" is unavailable: {e}', infra=e.cause)
        except Exception as e:
            logger.warning("tool %r raised %s: %s", call.name, type(e).__name__, e, exc_info=True)
            return self._fail(f'tool "{call.name}" failed: {type(e).__name__}: {e}', infra="tool_crash")
        return ToolResult(text=resp.text, reward=reward, metrics=metrics, image=resp.image)

    async def calc_reward(self) -> float:
        """Sum of `calc_reward` over the created tools (calc_reward_kwargs applied). A tool with a
        ``reward_metrics(instance_id) -> dict`` method adds its named metrics to ``self.reward_metrics``.

        A tool that was never created (its `create` failed), or whose calc_reward raises or returns
        a non-finite value, makes this raise `RuntimeError` naming it: a reward that could not be
        computed is an infrastructure failure, never a silent 0.0.
        """
        for name, error in self.create_errors.items():
            raise RuntimeError(f'tool "{name}": no reward: its create failed ({error})')
        total = 0.0
        for name, iid in self.instance_ids.items():
            try:
                coro = self.tools[name].calc_reward(iid, **self._kw(name, "calc_reward_kwargs"))
                value = float(await asyncio.wait_for(coro, self.timeout) or 0.0)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                raise RuntimeError(f'tool "{name}": calc_reward failed: {type(e).__name__}: {e}') from e
            if not math.isfinite(value):
                raise RuntimeError(f'tool "{name}": calc_reward returned a non-finite value ({value})')
            total += value
            named = getattr(self.tools[name], "reward_metrics", None)  # optional: named parts of the reward
            if named is not None:
                self.reward_metrics.update(named(iid))
        return total

    def metrics(self) -> dict[str, float]:
        """Counts for the trajectory's metrics: tool_calls, tool_errors, tool_timeouts."""
        return dict(self.stats)
