"""Tool-call parsers: the model's text -> content + tool calls, keeping what could not be parsed.

Formats:
- ``hermes`` (Hermes, Qwen2.5, Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  any number per turn, text around them is the content.
- ``llama3_json`` (Llama 3.1/3.2/3.3): the message is one or more JSON objects
  ``{"name": ..., "parameters": {...}}`` (optionally after ``<|python_tag|>``, separated by ``;``).
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` and the newer
  ``[TOOL_CALLS]name[ARGS]{...}`` form.
- ``qwen3_coder``, ``glm45``, ``deepseek``, ``kimi_k2``, ``harmony`` (gpt-oss), ``llama4_pythonic``: see the
  modules of `verl_agent.formats`.

Reasoning: every parser but the JSON-only Llama 3 / Mistral ones separates the reasoning before the answer
(``<think>`` blocks; harmony's analysis channel) into `ParseResult.reasoning`. `parse(text, tools)` takes
the tools' OpenAI schemas, which the formats whose arguments arrive as strings use to type them.

Malformed calls (unclosed tag, bad or partial JSON, missing name, non-object
arguments) never vanish: each becomes an entry in `ParseResult.errors` that
quotes the raw text, so the agent loop can show the model an error message.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from verl_agent.formats.base import ParseResult, add as _add, call_from_obj as _call_from_obj, decode_objects
from verl_agent.formats.base import quote as _quote, strip_markers as _strip_markers
from verl_agent.formats.detect import format_from_template
from verl_agent.formats.harmony import HarmonyParser
from verl_agent.formats.pythonic import PythonicParser
from verl_agent.formats.reasoning import THINK_CLOSE, THINK_OPEN, split_think
from verl_agent.formats.special_tokens import DeepSeekParser, KimiK2Parser
from verl_agent.formats.xml_calls import Glm45Parser, Qwen3CoderParser

__all__ = ["FORMATS", "THINK_CLOSE", "THINK_OPEN", "ParseResult", "ToolCallParser", "decode_reply", "detect_format", "get_parser",
           "split_reasoning"]

Tools = Sequence[Mapping[str, Any]] | None


class ToolCallParser(Protocol):
    name: str
    markers: tuple[str, ...]  # the tokens the parser must see (see decode_reply)

    def parse(self, text: str, tools: Tools = None) -> ParseResult:
        """Content, reasoning, calls and errors of one reply; `tools`: OpenAI schemas (to type string args)."""
        ...


class HermesParser:
    """``<tool_call>{json}</tool_call>`` blocks (Hermes / Qwen2.5 / Qwen3).

    A block's JSON is decoded first and its end tag looked for after it, so a ``</tool_call>`` inside a
    string argument (code, a regex) does not cut the call short; a block may hold several objects."""

    name = "hermes"
    _open, _close = "<tool_call>", "</tool_call>"
    markers = (_open, _close, THINK_OPEN, THINK_CLOSE)

    def parse(self, text: str, tools: Tools = None) -> ParseResult:
        reasoning, text = split_think(_strip_markers(text))  # Qwen3 thinks first
        result = ParseResult(content="", reasoning=reasoning)
        pieces: list[str] = []
        pos, i = 0, 0
        while (start := text.find(self._open, pos)) >= 0:
            pieces.append(text[pos:start])
            body_at = start + len(self._open)
            objs, rest = decode_objects(text[body_at:])
            if objs and rest.startswith(self._close):  # rest: what follows the objects, separators skipped
                pos = len(text) - len(rest) + len(self._close)
                for obj, raw in objs:
                    _add(result, _call_from_obj(obj, raw, f"tool_call {i}", ("arguments", "parameters")))
                    i += 1
                continue
            end = text.find(self._close, body_at)
            if end < 0:  # opened but never closed: usually cut off by the length limit
                result.errors.append(f"unclosed <tool_call> (no </tool_call>): {_quote(text[start:])}")
                pos = len(text)
                break
            body = text[body_at:end].strip()
            try:
                json.loads(body)
                message = "not a JSON object followed by </tool_call>"
            except json.JSONDecodeError as e:
                message = f"invalid JSON ({e.msg} at char {e.pos})"
            result.errors.append(f"tool_call {i}: {message}: {_quote(body)}")
            i += 1
            pos = end + len(self._close)
        pieces.append(text[pos:])
        result.content = "\n".join(p.strip() for p in pieces if p.strip())
        return result


class Llama3JsonParser:
    """Llama 3.x JSON tool calls: the whole message is ``{"name": ..., "parameters": {...}}`` (maybe several)."""

    name = "llama3_json"
    markers = ("<|python_tag|>",)

    def parse(self, text: str, tools: Tools = None) -> ParseResult:
        text = _strip_markers(text)
        body = text.strip()
        tagged = body.startswith("<|python_tag|>")
        if tagged:
            body = body[len("<|python_tag|>") :].lstrip()
        if not body.startswith("{"):
            return ParseResult(content=text.strip())
        objs, rest = decode_objects(body)
        result = ParseResult(content="")
        if not objs or not (isinstance(objs[0][0], dict) and ("name" in objs[0][0] or "function" in objs[0][0])):
            if tagged or not objs:  # tagged means the model meant a call; untagged bad JSON may be plain text
                result.errors.append(f"tool call: invalid or partial JSON: {_quote(body)}")
                return result
            return ParseResult(content=text.strip())
        for i, (obj, raw) in enumerate(objs):
            _add(result, _call_from_obj(obj, raw, f"tool call {i}", ("parameters", "arguments")))
        if rest.strip():
            result.errors.append(f"tool call {len(objs)}: invalid or partial JSON: {_quote(rest.strip())}")
        return result


class MistralParser:
    """``[TOOL_CALLS][{...}, ...]`` (v3) and ``[TOOL_CALLS]name[ARGS]{...}`` (v11+)."""

    name = "mistral"
    _tag = "[TOOL_CALLS]"
    markers = (_tag, "[ARGS]", "[CALL_ID]")

    def parse(self, text: str, tools: Tools = None) -> ParseResult:
        text = _strip_markers(text)
        if self._tag not in text:
            return ParseResult(content=text.strip())
        head, *chunks = text.split(self._tag)
        result = ParseResult(content=head.strip())
        for chunk in chunks:
            body = chunk.strip()
            if "[ARGS]" in body and not body.startswith(("[", "{")):
                self._parse_args_form(body, result)
            else:
                self._parse_json_form(body, result)
        return result

    def _parse_json_form(self, body: str, result: ParseResult) -> None:
        objs, rest = decode_objects(body)
        k = len(result.tool_calls) + len(result.errors)
        for obj, raw in objs:
            for item in obj if isinstance(obj, list) else [obj]:
                _add(result, _call_from_obj(item, raw, f"tool call {k}", ("arguments", "parameters")))
                k += 1
        if rest.strip() or not objs:
            result.errors.append(f"tool call {k}: invalid or partial JSON after [TOOL_CALLS]: {_quote(rest or body)}")

    def _parse_args_form(self, body: str, result: ParseResult) -> None:
        k = len(result.tool_calls) + len(result.errors)
        name, _, args_text = body.partition("[ARGS]")
        name, _, call_id = name.partition("[CALL_ID]")  # v13+: name[CALL_ID]id[ARGS]{...}
        objs, rest = decode_objects(args_text)
        if len(objs) != 1 or rest.strip():
            result.errors.append(f"tool call {k}: invalid or partial JSON arguments for {name.strip()!r}: {_quote(body)}")
            return
        obj = {"name": name.strip(), "arguments": objs[0][0], "id": call_id.strip()}
        _add(result, _call_from_obj(obj, body, f"tool call {k}", ("arguments",)))


# The one list of format names: name -> parser class (aliases below). Keep docs/extending.md's table in step.
_PARSERS: dict[str, type] = {
    "hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser,
    "qwen3_coder": Qwen3CoderParser, "glm45": Glm45Parser, "deepseek": DeepSeekParser, "kimi_k2": KimiK2Parser,
    "harmony": HarmonyParser, "llama4_pythonic": PythonicParser,
}
_ALIASES = {"qwen": "hermes", "qwen2_5": "hermes", "qwen25": "hermes", "qwen3": "hermes", "llama3": "llama3_json",
            "qwen3_5": "qwen3_coder", "glm4_moe": "glm45", "glm47": "glm45", "deepseek_v31": "deepseek",
            "deepseek_v3": "deepseek", "deepseek_v32": "deepseek", "kimi": "kimi_k2", "gpt_oss": "harmony",
            "openai": "harmony", "llama4": "llama4_pythonic", "pythonic": "llama4_pythonic"}  # fmt: skip
FORMATS = tuple(_PARSERS)


def detect_format(tokenizer: Any) -> str:
    """The format of the tokenizer's chat template (formats/detect.py), else a guess from its vocabulary;
    'hermes' when nothing tells."""
    found = format_from_template(getattr(tokenizer, "chat_template", None))
    if isinstance(found, str):
        return found
    vocab = tokenizer.get_vocab() if tokenizer is not None else {}
    if "<|channel|>" in vocab and "<|message|>" in vocab:
        return "harmony"
    if "<｜tool▁calls▁begin｜>" in vocab:
        return "deepseek"
    if "<|tool_calls_section_begin|>" in vocab:
        return "kimi_k2"
    if "<tool_call>" in vocab:
        return "hermes"
    if "[TOOL_CALLS]" in vocab:
        return "mistral"
    if "<|python_tag|>" in vocab or "<|eot_id|>" in vocab:
        return "llama3_json"
    return "hermes"


def split_reasoning(parser: ToolCallParser | None, text: str) -> tuple[str, str]:
    """(reasoning, the rest) of a reply that is not parsed for tool calls (no tools): harmony's analysis
    channel or ``<think>`` blocks, by the parser's format; ("", text) without a parser."""
    if parser is None:
        return "", text
    if getattr(parser, "reasoning_style", "think") == "harmony":
        parsed = parser.parse(text)
        return parsed.reasoning, parsed.content
    if parser.name in ("llama3_json", "mistral"):
        return "", text
    return split_think(text)


def decode_reply(tokenizer: Any, ids: list[int], parser: ToolCallParser | None = None) -> str:
    """A reply's text, special tokens skipped except the parser's markers.

    Mistral tokenizers mark [TOOL_CALLS] (and [ARGS], [CALL_ID]) as special tokens: decoding with
    skip_special_tokens alone would hide every tool call from the parser. Markers that a tokenizer keeps
    anyway (Qwen's <tool_call> is not special) change nothing.
    """
    hidden: dict[int, str] = getattr(parser, "hidden_markers", {})
    if not hidden or not hidden.keys() & set(ids):
        return tokenizer.decode(ids, skip_special_tokens=True)
    out, run = [], []
    for i in ids:
        if i in hidden:
            out += [tokenizer.decode(run, skip_special_tokens=True), hidden[i]]
            run = []
        else:
            run.append(i)
    return "".join([*out, tokenizer.decode(run, skip_special_tokens=True)])


def hidden_markers(tokenizer: Any, markers: tuple[str, ...]) -> dict[int, str]:
    """{id: marker} for the markers that are single tokens which skip_special_tokens would drop."""
    found = {}
    for m in markers:
        ids = tokenizer.encode(m, add_special_tokens=False)
        if len(ids) == 1 and not tokenizer.decode(ids, skip_special_tokens=True):
            found[ids[0]] = m
    return found


def parser_key(format: str) -> str:
    """The parser a format name selects (aliases such as 'qwen' resolved)."""
    return _ALIASES.get(format, format)


def get_parser(format: str | None = None, tokenizer: Any = None) -> ToolCallParser:
    """Parser for `format` (one of FORMATS or an alias; None = detect from `tokenizer`)."""
    if format is None:
        format = detect_format(tokenizer)
    key = parser_key(format)
    if key not in _PARSERS:
        raise ValueError(f"unknown tool-call format {format!r}; choose one of {sorted(FORMATS)} (or None to detect)")
    parser = _PARSERS[key]()
    if hasattr(tokenizer, "decode"):  # what decode_reply must keep for this parser (detection needs a vocab only)
        parser.hidden_markers = hidden_markers(tokenizer, parser.markers)
    return parser
