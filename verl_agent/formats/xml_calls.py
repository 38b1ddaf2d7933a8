"""Tool calls whose arguments are tagged strings, typed afterwards by the tool's JSON Schema (typed_args.py).

- ``qwen3_coder`` (Qwen3-Coder, Qwen3.5/3.6; format of their chat templates on the Hugging Face hub and
  vLLM's ``qwen3_coder`` tool parser)::

      <tool_call>
      <function=get_weather>
      <parameter=city>
      Paris
      </parameter>
      </function>
      </tool_call>

- ``glm45`` (GLM-4.5 / 4.6 / 4.7; their chat templates and vLLM's ``glm45`` parser)::

      <tool_call>get_weather
      <arg_key>city</arg_key>
      <arg_value>Paris</arg_value>
      </tool_call>

  GLM-4.7 writes no newline after the name. Values that are not strings are written as JSON.

Both think in ``<think>`` blocks first (reasoning.py).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from verl_agent.formats.base import ParseResult, blocks, decode_objects, quote, strip_markers
from verl_agent.formats.reasoning import THINK_CLOSE, THINK_OPEN, split_think
from verl_agent.formats.typed_args import ArgumentTypeError, schemas_by_name, typed_arguments
from verl_agent.protocol import ToolCall

__all__ = ["Glm45Parser", "Qwen3CoderParser"]

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


def _typed(name: str, raw: dict[str, str], schemas: Mapping[str, Any], where: str, body: str) -> ToolCall | str:
    try:
        return ToolCall(name=name, arguments=typed_arguments(raw, name, schemas))
    except ArgumentTypeError as e:
        return f"{where}: {e}: {quote(body)}"


def _one_newline(value: str) -> str:
    """The value as written: the template puts one newline on each side of it."""
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


class Qwen3CoderParser:
    """``<tool_call><function=NAME><parameter=P>value</parameter></function></tool_call>``; see the module."""

    name = "qwen3_coder"
    markers = (_OPEN, _CLOSE, THINK_OPEN, THINK_CLOSE)
    _FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(</function>|\Z)", re.S)
    _PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)(</parameter>|(?=<parameter=)|\Z)", re.S)

    def parse(self, text: str, tools: Sequence[Mapping[str, Any]] | None = None) -> ParseResult:
        reasoning, text = split_think(strip_markers(text))
        result = ParseResult(content="", reasoning=reasoning)
        schemas = schemas_by_name(tools)
        for body in blocks(text, _OPEN, _CLOSE, result):
            where = f"tool call {len(result.tool_calls) + len(result.errors)}"
            functions = list(self._FUNCTION.finditer(body))
            if not functions:
                result.errors.append(f"{where}: no <function=NAME> in the block: {quote(body)}")
                continue
            for fn in functions:
                self._function(fn, body, schemas, where, result)
        return result

    def _function(self, fn: re.Match, body: str, schemas: Mapping[str, Any], where: str, result: ParseResult) -> None:
        name, inner, closed = fn.group(1).strip(), fn.group(2), fn.group(3)
        if not closed:
            result.errors.append(f"{where}: <function={name}> is not closed by </function>: {quote(body)}")
            return
        raw: dict[str, str] = {}
        for p in self._PARAM.finditer(inner):
            if not p.group(3):
                result.errors.append(f"{where}: <parameter={p.group(1)}> of {name!r} is not closed: {quote(body)}")
                return
            raw[p.group(1).strip()] = _one_newline(p.group(2))
        stray = self._PARAM.sub("", inner).strip()
        if stray:
            result.errors.append(f"{where}: text outside any <parameter=...> in {name!r}: {quote(stray)}")
            return
        call = _typed(name, raw, schemas, where, body)
        (result.tool_calls if isinstance(call, ToolCall) else result.errors).append(call)  # type: ignore[arg-type]


class Glm45Parser:
    """``<tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>``; see the module."""

    name = "glm45"
    markers = (_OPEN, _CLOSE, THINK_OPEN, THINK_CLOSE, "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")
    _PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)

    def parse(self, text: str, tools: Sequence[Mapping[str, Any]] | None = None) -> ParseResult:
        reasoning, text = split_think(strip_markers(text))
        result = ParseResult(content="", reasoning=reasoning)
        schemas = schemas_by_name(tools)
        for body in blocks(text, _OPEN, _CLOSE, result):
            where = f"tool call {len(result.tool_calls) + len(result.errors)}"
            call = self._call(body, schemas, where)
            (result.tool_calls if isinstance(call, ToolCall) else result.errors).append(call)  # type: ignore[arg-type]
        return result

    def _call(self, body: str, schemas: Mapping[str, Any], where: str) -> ToolCall | str:
        cut = body.find("<arg_key>")
        name, args_text = (body, "") if cut < 0 else (body[:cut], body[cut:])
        name = name.strip()
        if name.endswith("}") and "{" in name:  # GLM-4's older form: name, then a JSON object
            name, _, rest = name.partition("{")
            objs, left = decode_objects("{" + rest)
            if len(objs) != 1 or left.strip() or not isinstance(objs[0][0], dict):
                return f"{where}: arguments of {name.strip()!r} are not one JSON object: {quote(body)}"
            return ToolCall(name=name.strip(), arguments=objs[0][0])
        if not name or any(c in name for c in "<>\n"):
            return f"{where}: missing function name before <arg_key>: {quote(body)}"
        raw = {k.strip(): v for k, v in self._PAIR.findall(args_text)}
        if self._PAIR.sub("", args_text).strip():
            return f"{where}: unpaired or unclosed <arg_key>/<arg_value> in {name!r}: {quote(body)}"
        return _typed(name, raw, schemas, where, body)
