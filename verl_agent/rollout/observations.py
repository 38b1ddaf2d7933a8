"""Turning one assistant turn's tool calls into tool messages (the observation the model sees next).

Nothing is dropped silently: calls beyond `max_parallel_calls` and tool calls
that failed to parse each become a tool message with an explicit error text.
Tool responses are truncated to `max_tool_response_length` CHARACTERS (not
tokens: the text is cut before it is tokenized, so the token-exact encoding of
the observation is never cut in the middle).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from verl_agent.protocol import Message, ToolCall

TRUNCATION_MARK = "...(truncated)..."


def truncate(text: str, limit: int, side: str) -> str:
    """Keep at most `limit` characters of `text`; `side` is the side that is cut: left | middle | right."""
    if len(text) <= limit:
        return text
    mark = TRUNCATION_MARK if limit > 2 * len(TRUNCATION_MARK) else ""
    keep = limit - len(mark)
    if side == "left":
        return mark + text[len(text) - keep :]
    if side == "right":
        return text[:keep] + mark
    if side == "middle":
        head = keep // 2
        return text[:head] + mark + text[len(text) - (keep - head) :]
    raise ValueError(f"tool_response_truncate_side must be left, middle or right, got {side!r}")


@dataclass
class ToolTurn:
    """What the tools of one turn produced."""

    messages: list[Message] = field(default_factory=list)
    reward: float = 0.0  # sum of the step rewards of the calls
    num_calls: int = 0  # calls the model asked for (parsed ones, run or refused)
    num_errors: int = 0  # failed, refused or unparsable calls
    seconds: float = 0.0
    metrics: list[dict[str, Any]] = field(default_factory=list)
    infra: tuple[str, str] | None = None  # (cause, message) of the first infrastructure failure of a call


def _tool_message(call: ToolCall | None, text: str) -> Message:
    if call is None:
        return Message(role="tool", content=text)
    return Message(role="tool", content=text, tool_call_id=call.id or None, name=call.name)


async def run_tool_calls(
    session: Any,
    calls: list[ToolCall],
    parse_errors: list[str],
    *,
    max_parallel_calls: int,
    max_chars: int,
    truncate_side: str,
) -> ToolTurn:
    """Run up to `max_parallel_calls` calls concurrently; answer every other call and parse error with an error."""
    out = ToolTurn(num_calls=len(calls))
    start = time.perf_counter()
    run, refused = calls[:max_parallel_calls], calls[max_parallel_calls:]
    results = await asyncio.gather(*(session.call(c) for c in run))
    for call, res in zip(run, results):
        out.messages.append(_tool_message(call, truncate(res.text, max_chars, truncate_side)))
        out.reward += float(res.reward)
        out.num_errors += 0 if res.ok else 1
        out.metrics.append(dict(res.metrics or {}))
        if res.infra and out.infra is None:
            out.infra = (res.infra, res.text)
    for call in refused:
        out.messages.append(
            _tool_message(
                call,
                f"Error: call to {call.name!r} was not run: at most {max_parallel_calls} tool call(s) per turn "
                f"(max_parallel_calls); {len(calls)} were requested.",
            )
        )
        out.num_errors += 1
    for err in parse_errors:
        text = truncate(f"Error: could not parse the tool call: {err}", max_chars, truncate_side)
        out.messages.append(_tool_message(None, text))
        out.num_errors += 1
    out.seconds = time.perf_counter() - start
    return out
