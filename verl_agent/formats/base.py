"""What every tool-call parser shares: the result type and the helpers that turn raw text into calls or errors.

A malformed call never vanishes: it becomes an entry in `ParseResult.errors` that quotes its raw text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from verl_agent.protocol import ToolCall

__all__ = ["ParseResult", "TRAILING_MARKERS", "add", "call_from_obj", "blocks", "decode_objects", "joined", "json_args", "quote",
           "strip_markers"]

# End-of-turn markers a decoder may leave at the end of the text; they are not content.
TRAILING_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|eot|>", "<|endoftext|>", "</s>", "<|end|>",
                    "<|return|>", "<|call|>", "<｜end▁of▁sentence｜>", "<|user|>", "<|observation|>")
_MAX_QUOTE = 300


@dataclass
class ParseResult:
    """`content`: the answer without reasoning and tool calls; `reasoning`: what the model thought before it
    (``<think>`` blocks, harmony's analysis channel); `errors`: one message per malformed call, quoting it."""

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    reasoning: str = ""


def quote(raw: str) -> str:
    return repr(raw if len(raw) <= _MAX_QUOTE else raw[:_MAX_QUOTE] + "...")


def strip_markers(text: str) -> str:
    """`text` without the end-of-turn markers (and whitespace) at its end."""
    changed = True
    while changed:
        changed = False
        stripped = text.rstrip()
        for m in TRAILING_MARKERS:
            if stripped.endswith(m):
                text, changed = stripped[: -len(m)], True
    return text


def call_from_obj(obj: Any, raw: str, where: str, arg_keys: tuple[str, ...]) -> ToolCall | str:
    """A ToolCall from a decoded JSON object, or an error message quoting `raw`."""
    if not isinstance(obj, dict):
        return f"{where}: expected a JSON object with 'name', got {type(obj).__name__}: {quote(raw)}"
    if isinstance(obj.get("function"), dict):  # OpenAI-style {"type": "function", "function": {...}}
        obj = {**obj["function"], "id": obj.get("id", "")}
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return f"{where}: missing or non-string 'name': {quote(raw)}"
    args: Any = next((obj[k] for k in arg_keys if k in obj), {})
    if isinstance(args, str):  # some models emit the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return f"{where}: arguments of {name!r} are a string that is not valid JSON ({e.msg}): {quote(raw)}"
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return f"{where}: arguments of {name!r} must be a JSON object, got {type(args).__name__}: {quote(raw)}"
    return ToolCall(name=name, arguments=args, id=str(obj.get("id") or ""))


def add(result: ParseResult, call: ToolCall | str) -> None:
    if isinstance(call, ToolCall):
        result.tool_calls.append(call)
    else:
        result.errors.append(call)


def decode_objects(text: str) -> tuple[list[tuple[Any, str]], str]:
    """Consecutive JSON values separated by whitespace / ';' / ','; returns them and the unparsed rest."""
    decoder = json.JSONDecoder()
    out: list[tuple[Any, str]] = []
    pos = 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n;,":
            pos += 1
        if pos >= len(text):
            return out, ""
        try:
            obj, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return out, text[pos:]
        out.append((obj, text[pos:end]))
        pos = end


def json_args(body: str, name: str, where: str) -> ToolCall | str:
    """A call of `name` whose arguments are the JSON object `body` (empty = no arguments), or an error."""
    body = body.strip()
    if not body:
        return ToolCall(name=name, arguments={})
    objs, rest = decode_objects(body)
    if len(objs) != 1 or rest.strip():
        return f"{where}: arguments of {name!r} are not one JSON object: {quote(body)}"
    return call_from_obj({"name": name, "arguments": objs[0][0]}, body, where, ("arguments",))


def joined(pieces: list[str]) -> str:
    """The content left between calls: non-empty pieces, stripped, one per line."""
    return "\n".join(p.strip() for p in pieces if p.strip())


def blocks(text: str, open_: str, close: str, result: ParseResult) -> list[str]:
    """The bodies of the `open_`...`close` blocks of `text`; the text around them becomes `result.content`
    and a block opened but never closed (usually cut off by the length limit) an error."""
    pieces, bodies, pos = [], [], 0
    while (start := text.find(open_, pos)) >= 0:
        pieces.append(text[pos:start])
        end = text.find(close, start + len(open_))
        if end < 0:
            result.errors.append(f"unclosed {open_} (no {close}): {quote(text[start:])}")
            pos = len(text)
            break
        bodies.append(text[start + len(open_):end])
        pos = end + len(close)
    pieces.append(text[pos:])
    result.content = joined(pieces)
    return bodies
