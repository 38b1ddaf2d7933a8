"""Llama 4's pythonic tool calls (Meta's Llama 4 prompt-format page; vLLM's ``llama4_pythonic`` parser)::

    [get_weather(city="Paris", days=3), get_time(zone="CET")]

optionally inside ``<|python_start|>...<|python_end|>``. Arguments are Python literals (JSON's
``true``/``false``/``null`` are read too); only keyword arguments are allowed. A reply that starts with such
a list is calls (or errors, when the list is malformed); text followed by a well-formed list at its end is
content and calls; anything else is the answer.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping, Sequence
from typing import Any

from verl_agent.formats.base import ParseResult, quote, strip_markers
from verl_agent.protocol import ToolCall

__all__ = ["PythonicParser"]

_START, _END = "<|python_start|>", "<|python_end|>"
_JSON_NAMES = {"true": True, "false": False, "null": None}
_LOOKS_LIKE_CALLS = re.compile(r"\[\s*[A-Za-z_][\w.]*\s*\(")


def _literal(node: ast.expr) -> Any:
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}  # type: ignore[arg-type]
    return ast.literal_eval(node)


def _call(node: ast.expr, where: str) -> ToolCall | str:
    if not isinstance(node, ast.Call):
        return f"{where}: expected a function call, got {quote(ast.unparse(node))}"
    name = ast.unparse(node.func)
    if node.args:
        return f"{where}: {name}() takes keyword arguments only: {quote(ast.unparse(node))}"
    try:
        return ToolCall(name=name, arguments={kw.arg: _literal(kw.value) for kw in node.keywords if kw.arg})
    except (ValueError, TypeError, SyntaxError) as e:  # a variable, an expression: not a literal
        return f"{where}: an argument of {name!r} is not a literal ({e}): {quote(ast.unparse(node))}"


class PythonicParser:
    """See the module docstring."""

    name = "llama4_pythonic"
    markers = (_START, _END)

    def parse(self, text: str, tools: Sequence[Mapping[str, Any]] | None = None) -> ParseResult:
        text = strip_markers(text).strip()
        head, tagged, body = text.partition(_START)
        if not tagged:
            head, body = self._split_tail(text)
            if body is None:
                return ParseResult(content=text)
        body = body.split(_END)[0].strip()
        result = ParseResult(content=head.strip())
        try:
            tree = ast.parse(body, mode="eval").body
        except SyntaxError as e:
            result.errors.append(f"tool calls: not a Python list of calls ({e.msg}): {quote(body)}")
            return result
        if not isinstance(tree, ast.List):
            result.errors.append(f"tool calls: expected [name(arg=value), ...]: {quote(body)}")
            return result
        for i, node in enumerate(tree.elts):
            call = _call(node, f"tool call {i}")
            (result.tool_calls if isinstance(call, ToolCall) else result.errors).append(call)  # type: ignore[arg-type]
        return result

    @staticmethod
    def _split_tail(text: str) -> tuple[str, str | None]:
        """(text before the calls, the calls) of an untagged reply; (text, None) when it makes no calls."""
        match = _LOOKS_LIKE_CALLS.search(text)
        if match is None:
            return text, None
        if match.start() == 0:  # the reply is meant as calls: a malformed list is an error, not an answer
            return "", text
        tail = text[match.start():]
        try:
            ok = tail.endswith("]") and isinstance(ast.parse(tail, mode="eval").body, ast.List)
        except SyntaxError:
            ok = False
        return (text[: match.start()], tail) if ok else (text, None)
