"""Context strategies: how the native agent loop rewrites a history that outgrows the context window.

A strategy maps the messages the model sees (the context) to shorter ones; the agent loop then starts a
new segment from them (`agent_loop.py`). The first `head` messages are the task (the sample's messages and
an interaction's first message); every built-in strategy keeps them.

- ``drop_observations``: tool results and user replies older than the last ``keep_last_turns`` assistant
  turns become a one-line placeholder naming what was dropped (its role, tool and size); messages shorter
  than their placeholder stay.
- ``truncate_middle``: the task, then the latest whole messages that fit ``keep_last_tokens`` tokens
  (the last message's text is cut from the left when it alone is longer).
- ``summarize``: the agent loop asks the policy (`summary_message` builds the restart).
- a user function ``fn(messages: list[dict]) -> list[dict]`` (OpenAI chat dicts; async allowed), or a strategy
  registered by name in ``verl_agent.registry.CONTEXT_STRATEGIES``: ``fn(strategy, messages, head)`` with
  `Message` objects (``strategy`` gives its config and token counts), registered like the built-ins below.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from verl_agent.imports import import_object
from verl_agent.protocol import Message
from verl_agent.registry import CONTEXT_STRATEGIES

__all__ = ["ContextError", "ContextStrategy", "DROPPED_PREFIX", "SUMMARY_PREFIX"]

DROPPED_PREFIX = "[dropped "
SUMMARY_PREFIX = "Summary of your work so far:\n"


class ContextError(Exception):
    """A user strategy raised or returned something that is not a list of messages (cause context_error)."""

    cause = "context_error"


def _dropped(m: Message) -> Message:
    what = f"{m.name} output" if m.role == "tool" and m.name else f"{m.role} message"
    text = f"{DROPPED_PREFIX}{what}, {len(m.content)} chars]"
    return Message(role=m.role, content=text, tool_call_id=m.tool_call_id, name=m.name)


def drop_observations(messages: list[Message], head: int, keep_last_turns: int) -> list[Message]:
    """Observations (tool / user messages after the task) older than the last `keep_last_turns` turns -> placeholders."""
    turns = [i for i in range(head, len(messages)) if messages[i].role == "assistant"]
    if keep_last_turns > len(turns):
        return list(messages)
    keep_from = turns[-keep_last_turns] if keep_last_turns else len(messages)
    out = list(messages)
    for i in range(head, keep_from):
        m = out[i]
        if m.role in ("tool", "user") and not m.content.startswith(DROPPED_PREFIX):
            short = _dropped(m)
            out[i] = short if len(short.content) < len(m.content) else m  # a placeholder never grows a message
    return out


def truncate_middle(messages: list[Message], head: int, keep_last_tokens: int,
                    count: Callable[[str], int], cut: Callable[[str, int], str]) -> list[Message]:  # fmt: skip
    """The task, then the latest whole messages within `keep_last_tokens` (by `count`); the tail starts at an
    assistant message where one fits; a last message longer than the budget keeps its last tokens (`cut`)."""
    tail, used = [], 0
    for m in reversed(messages[head:]):
        n = count(m.content) + sum(count(str(c.arguments)) + count(c.name) for c in m.tool_calls)
        if used + n > keep_last_tokens:
            if not tail:
                tail.append(Message(role=m.role, content=cut(m.content, keep_last_tokens), tool_calls=m.tool_calls,
                                    tool_call_id=m.tool_call_id, name=m.name))  # fmt: skip
            break
        tail.append(m)
        used += n
    tail.reverse()
    first_assistant = next((i for i, m in enumerate(tail) if m.role == "assistant"), 0)
    return [*messages[:head], *tail[first_assistant:]]


def summary_message(text: str) -> Message:
    """The user message the history restarts with after a summary turn (after the task)."""
    return Message(role="user", content=SUMMARY_PREFIX + text.strip())


# Registered values rewrite the context; None where the agent loop acts itself (none: never; summarize: it asks
# the policy for a summary and restarts from `summary_message`).
CONTEXT_STRATEGIES.register("none", None)
CONTEXT_STRATEGIES.register("summarize", None)
CONTEXT_STRATEGIES.register("drop_observations",
                            lambda s, messages, head: drop_observations(messages, head, s.cfg.keep_last_turns))
CONTEXT_STRATEGIES.register("truncate_middle", lambda s, messages, head: truncate_middle(
    messages, head, s.cfg.keep_last_tokens, s.count, s.cut))


class ContextStrategy:
    """The configured strategy (`multi_turn.context`), bound to a tokenizer for token counts."""

    def __init__(self, cfg: Any, tokenizer: Any) -> None:
        self.cfg, self.name, self.tokenizer = cfg, cfg.strategy, tokenizer
        self.user_fn: Callable[..., Any] | None = None
        self.registered: Callable[..., Any] | None = None
        if self.name in CONTEXT_STRATEGIES:
            self.registered = CONTEXT_STRATEGIES.get(self.name)
        else:
            try:
                self.user_fn = import_object(self.name)
            except (ImportError, AttributeError) as e:
                raise ValueError(f"actor_rollout_ref.rollout.multi_turn.context.strategy={self.name!r}: {e}") from e
            if not callable(self.user_fn):
                raise ValueError(f"actor_rollout_ref.rollout.multi_turn.context.strategy={self.name!r} is not callable")

    @property
    def enabled(self) -> bool:
        return self.name != "none"

    async def rewrite(self, messages: list[Message], head: int) -> list[Message]:
        """The rewritten context (not for `summarize`, which the agent loop runs); raises ContextError."""
        if self.registered is not None:
            return await self._call(lambda: self.registered(self, messages, head))  # type: ignore[misc]
        assert self.user_fn is not None
        return await self._call(lambda: self.user_fn([m.to_chat() for m in messages]))  # type: ignore[misc]

    async def _call(self, run: Callable[[], Any]) -> list[Message]:
        where = f"context strategy {self.name}"
        try:
            out = run()
            if inspect.isawaitable(out):
                out = await out
        except Exception as e:
            raise ContextError(f"{where} raised {type(e).__name__}: {e}") from e
        if not isinstance(out, list) or not out:
            raise ContextError(f"{where} returned {type(out).__name__}, expected a non-empty list of messages")
        try:
            return [m if isinstance(m, Message) else Message.from_chat(m, where=f"{where} result[{i}]")
                    for i, m in enumerate(out)]  # fmt: skip
        except ValueError as e:
            raise ContextError(str(e)) from e

    def count(self, text: str) -> int:
        """Tokens of `text` (no special tokens)."""
        return len(self.tokenizer.encode(text, add_special_tokens=False)) if text else 0

    def cut(self, text: str, n: int) -> str:
        """The last `n` tokens of `text`."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.decode(ids[-n:]) if len(ids) > n else text
