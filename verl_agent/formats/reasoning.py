"""Reasoning before the answer: ``<think>...</think>`` (Qwen3, DeepSeek R1/V3.1+, GLM-4.5, Kimi K2 Thinking).

Where the chat template opens the block in the generation prompt (Qwen3-Thinking-2507, DeepSeek V3.1 in
thinking mode, GLM-4.5 with thinking forced), the reply starts inside it and only ``</think>`` is
generated: then everything before the first ``</think>`` is the reasoning. A block opened and never
closed (the reply was cut off while thinking) is all reasoning and no answer.
"""

from __future__ import annotations

__all__ = ["THINK_CLOSE", "THINK_OPEN", "split_think"]

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def split_think(text: str) -> tuple[str, str]:
    """(reasoning, the rest) of a reply; ("", text) when it does not think."""
    body = text.lstrip()
    if body.startswith(THINK_OPEN):
        inner = body[len(THINK_OPEN):]
        end = inner.find(THINK_CLOSE)
        if end < 0:
            return inner.strip(), ""
        return inner[:end].strip(), inner[end + len(THINK_CLOSE):]
    end = text.find(THINK_CLOSE)
    if end >= 0 and THINK_OPEN not in text[:end]:  # opened by the generation prompt
        return text[:end].strip(), text[end + len(THINK_CLOSE):]
    return "", text


def think_hold(text: str) -> int:
    """While streaming: how much of `text` may be shown as reasoning so far (0 until a block is seen open)."""
    body = text.lstrip()
    if not body.startswith(THINK_OPEN):
        return 0
    return len(text) - len(body) + len(THINK_OPEN)
