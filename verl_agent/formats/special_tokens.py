"""Tool calls framed by special tokens, arguments as JSON (or tagged, DeepSeek V3.2).

- ``deepseek`` (DeepSeek V3.1 / V3.1-Terminus / V3.2-Exp; their chat templates on the Hugging Face hub and
  vLLM's ``deepseek_v31`` parser)::

      <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>

  also reads V3-0324 / R1-0528's ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`` + a fenced JSON block,
  and V3.2's DSML (``<｜DSML｜function_calls>`` / ``<｜DSML｜invoke name=..>`` / ``<｜DSML｜parameter
  name=.. string="true|false">``, from DeepSeek-V3.2's ``encoding`` folder on the hub).
- ``kimi_k2`` (Kimi K2 / K2-Instruct-0905 / K2-Thinking; the model card's tool-calling guide)::

      <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

  The call id is the ``functions.NAME:INDEX`` the model wrote (Kimi's template renders it back).

Both think in ``<think>`` blocks first (reasoning.py).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from verl_agent.formats.base import ParseResult, add, blocks, json_args, quote, strip_markers
from verl_agent.formats.reasoning import THINK_CLOSE, THINK_OPEN, split_think
from verl_agent.protocol import ToolCall

__all__ = ["DeepSeekParser", "KimiK2Parser"]

_DS = {k: f"<｜{v}｜>" for k, v in {"calls": "tool▁calls▁begin", "calls_end": "tool▁calls▁end", "call": "tool▁call▁begin",
                                    "call_end": "tool▁call▁end", "sep": "tool▁sep"}.items()}
_DSML = "｜DSML｜"


class DeepSeekParser:
    """DeepSeek V3.x tool-call tokens; see the module docstring."""

    name = "deepseek"
    markers = (*_DS.values(), THINK_OPEN, THINK_CLOSE)
    _FENCED = re.compile(r"^\s*function\s*$")
    _INVOKE = re.compile(rf'<{_DSML}invoke\s+name="([^"]*)"\s*>(.*?)</{_DSML}invoke>', re.S)
    _PARAM = re.compile(rf'<{_DSML}parameter\s+name="([^"]*)"\s+string="(true|false)"\s*>(.*?)</{_DSML}parameter>', re.S)

    def parse(self, text: str, tools: Sequence[Mapping[str, Any]] | None = None) -> ParseResult:
        reasoning, text = split_think(strip_markers(text))
        result = ParseResult(content="", reasoning=reasoning)
        if f"<{_DSML}function_calls>" in text:
            for body in blocks(text, f"<{_DSML}function_calls>", f"</{_DSML}function_calls>", result):
                self._dsml(body, result)
            return result
        for section in blocks(text, _DS["calls"], _DS["calls_end"], result):
            self._section(section, result)
        return result

    def _section(self, section: str, result: ParseResult) -> None:
        inner = ParseResult(content="")
        for body in blocks(section, _DS["call"], _DS["call_end"], inner):
            where = f"tool call {len(result.tool_calls) + len(result.errors)}"
            head, sep, args = body.partition(_DS["sep"])
            if not sep:
                result.errors.append(f"{where}: no {_DS['sep']} between name and arguments: {quote(body)}")
            elif self._FENCED.match(head):  # V3 / R1: function<sep>NAME\n```json\n{...}\n```
                name, _, fenced = args.partition("\n")
                add(result, json_args(fenced.strip().removeprefix("```json").removesuffix("```"), name.strip(), where))
            else:
                add(result, json_args(args, head.strip(), where))
        result.errors += inner.errors
        if inner.content:
            result.errors.append(f"text between tool calls: {quote(inner.content)}")

    def _dsml(self, body: str, result: ParseResult) -> None:
        for name, inner in self._INVOKE.findall(body):
            where = f"tool call {len(result.tool_calls) + len(result.errors)}"
            args: dict[str, Any] = {}
            try:
                for key, is_string, value in self._PARAM.findall(inner):
                    args[key] = value if is_string == "true" else json.loads(value)
            except json.JSONDecodeError as e:
                result.errors.append(f"{where}: a string=\"false\" parameter of {name!r} is not JSON ({e.msg}): "
                                     f"{quote(inner)}")  # fmt: skip
                continue
            if self._PARAM.sub("", inner).strip():
                result.errors.append(f"{where}: unclosed or malformed <{_DSML}parameter> in {name!r}: {quote(inner)}")
                continue
            result.tool_calls.append(ToolCall(name=name, arguments=args))
        if self._INVOKE.sub("", body).strip():
            result.errors.append(f"unclosed or malformed <{_DSML}invoke>: {quote(self._INVOKE.sub('', body).strip())}")


_KIMI = {"calls": "<|tool_calls_section_begin|>", "calls_end": "<|tool_calls_section_end|>",
         "call": "<|tool_call_begin|>", "call_end": "<|tool_call_end|>", "args": "<|tool_call_argument_begin|>"}


class KimiK2Parser:
    """Kimi K2's tool-call section; see the module docstring."""

    name = "kimi_k2"
    markers = (*_KIMI.values(), THINK_OPEN, THINK_CLOSE)
    _ID = re.compile(r"^(?:functions\.)?([\w\-.]+?):(\d+)$")

    def parse(self, text: str, tools: Sequence[Mapping[str, Any]] | None = None) -> ParseResult:
        reasoning, text = split_think(strip_markers(text))
        result = ParseResult(content="", reasoning=reasoning)
        for section in blocks(text, _KIMI["calls"], _KIMI["calls_end"], result):
            inner = ParseResult(content="")
            for body in blocks(section, _KIMI["call"], _KIMI["call_end"], inner):
                where = f"tool call {len(result.tool_calls) + len(result.errors)}"
                head, sep, args = body.partition(_KIMI["args"])
                match = self._ID.match(head.strip())
                if not sep or not match:
                    result.errors.append(f"{where}: expected functions.NAME:INDEX{_KIMI['args']}{{...}}: {quote(body)}")
                    continue
                call = json_args(args, match.group(1), where)
                if isinstance(call, ToolCall):
                    call.id = head.strip()
                add(result, call)
            result.errors += inner.errors
            if inner.content:
                result.errors.append(f"text between tool calls: {quote(inner.content)}")
        return result
