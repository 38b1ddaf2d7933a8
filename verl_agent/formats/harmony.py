"""gpt-oss's harmony format (OpenAI's "harmony response format" guide, openai-harmony on PyPI).

The generation prompt ends with ``<|start|>assistant``; the reply is one or more messages::

    <|channel|>analysis<|message|>THINKING<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

or ``...<|start|>assistant<|channel|>final<|message|>ANSWER<|return|>``. The recipient may also stand in
the role part (``<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>``).
``analysis`` is the reasoning, ``final`` (and ``commentary`` without a recipient, the preamble shown to
the user) the content, a message to ``functions.NAME`` a call. ``<|end|>`` closes one message, not the
turn: only ``<|call|>`` and ``<|return|>`` end it (chat.py leaves ``<|end|>`` out of the stop ids).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from verl_agent.formats.base import ParseResult, add, json_args, quote, strip_markers

__all__ = ["HARMONY_MARKERS", "HarmonyParser"]

HARMONY_MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>", "<|call|>", "<|return|>")
_ENDS = ("<|end|>", "<|call|>", "<|return|>")


class HarmonyParser:
    """See the module docstring."""

    name = "harmony"
    markers = HARMONY_MARKERS
    reasoning_style = "harmony"
    _TO = re.compile(r"\bto=(\S+?)(?=\s|<\||$)")

    def parse(self, text: str, tools: Sequence[Mapping[str, Any]] | None = None) -> ParseResult:
        result = ParseResult(content="")
        reasoning, content = [], []
        for k, chunk in enumerate(text.split("<|start|>")):
            if not chunk.strip():
                continue
            where = f"message {k}"
            if k and not chunk.startswith("assistant"):
                result.errors.append(f"{where}: the reply may only hold assistant messages: {quote(chunk)}")
                continue
            header, sep, body = chunk.partition("<|message|>")
            if not sep and k == 0 and "<|channel|>" not in chunk:  # no harmony header at all: plain text
                content.append(strip_markers(chunk).strip())
                continue
            if not sep:
                result.errors.append(f"{where}: no <|message|> after the header: {quote(chunk)}")
                continue
            for end in _ENDS:
                body = body.split(end)[0]
            channel = header.partition("<|channel|>")[2].split("<|constrain|>")[0].split()
            recipient = self._TO.search(header)
            if recipient:
                name = recipient.group(1).removeprefix("functions.")
                add(result, json_args(body, name, f"tool call {len(result.tool_calls) + len(result.errors)}"))
            elif channel and channel[0] == "analysis":
                reasoning.append(body.strip())
            else:  # final, or a commentary preamble meant for the user
                content.append(body.strip())
        result.reasoning = "\n".join(r for r in reasoning if r)
        result.content = "\n".join(c for c in content if c)
        return result
