"""OpenAI Chat Completions wire format: request validation and response / SSE chunk bodies.

Pure functions on dicts, no HTTP: `parse_request` turns a JSON body into a `ChatRequest` or
raises `RequestError` (status, OpenAI error body); `completion_body` and `stream_chunks`
render a `Reply`. Field names and shapes follow the public API reference
(https://platform.openai.com/docs/api-reference/chat): arguments of tool calls are JSON
strings, `content` is null when the message only calls tools, streams end with `data: [DONE]`.
"""

from __future__ import annotations

import functools
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

from verl_agent.parsers import THINK_CLOSE, THINK_OPEN, decode_reply
from verl_agent.protocol import ROLES, Message
from verl_agent.rollout.openai.recorder import Reply

__all__ = ["ChatRequest", "RequestError", "StreamText", "chunk_head", "completion_body", "content_chunk", "delta_chunk", "error_body",
           "final_chunks", "forced_prefix", "parse_request", "role_chunk"]

_IGNORED = {"user", "metadata", "store", "service_tier", "parallel_tool_calls", "presence_penalty",
            "frequency_penalty", "logit_bias", "response_format", "reasoning_effort", "modalities"}  # fmt: skip
_KNOWN = _IGNORED | {"model", "messages", "tools", "tool_choice", "temperature", "top_p", "seed", "max_tokens",
                     "max_completion_tokens", "stop", "n", "logprobs", "top_logprobs", "stream", "stream_options"}


class RequestError(Exception):
    """A request the endpoint refuses: HTTP `status` with an OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error") -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.param, self.code, self.type = status, param, code, type


def error_body(e: RequestError) -> dict[str, Any]:
    return {"error": {"message": str(e), "type": e.type, "param": e.param, "code": e.code}}


@dataclass
class ChatRequest:
    model: str
    messages: list[Message]
    tools: list[dict] | None = None
    tool_choice: str | None = None  # None/"auto"/"required": parse calls; "none": never; else the one allowed name
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False
    stream: bool = False
    include_usage: bool = False
    sampling: dict[str, float] = field(default_factory=dict)  # temperature / top_p / seed the agent asked for


def _bad(msg: str, param: str | None = None, code: str | None = None) -> RequestError:
    return RequestError(400, msg, param, code)


def _content(v: Any, where: str) -> str:
    if v is None or isinstance(v, str):
        return v or ""
    if isinstance(v, list):  # content parts: only text can be encoded
        if all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in v):
            return "".join(p["text"] for p in v)
        raise _bad(f"{where}: only text content parts are supported", where)
    raise _bad(f"{where}: must be a string or a list of text parts, got {type(v).__name__}", where)


def _messages(raw: Any) -> list[Message]:
    if not isinstance(raw, list) or not raw:
        raise _bad("'messages' must be a non-empty array", "messages")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(f"{where}: expected an object", where)
        role = "system" if m.get("role") == "developer" else m.get("role")
        if role not in ROLES:
            raise _bad(f"{where}.role: must be one of {list(ROLES)} (or 'developer'), got {m.get('role')!r}",
                       f"{where}.role", "invalid_role")  # fmt: skip
        d = {**m, "role": role, "content": _content(m.get("content"), f"{where}.content")}
        try:
            out.append(Message.from_chat(d, where))
        except (ValueError, AttributeError, TypeError) as e:  # json.JSONDecodeError is a ValueError
            raise _bad(f"{where}: {e}", where) from e
    return out


def _tools(raw: Any) -> list[dict] | None:
    if raw is None or raw == []:
        return None
    if not isinstance(raw, list):
        raise _bad("'tools' must be an array of function tools", "tools")
    try:
        key = json.dumps(raw, sort_keys=True)
    except (TypeError, ValueError) as e:
        raise _bad(f"'tools' is not JSON-serializable: {e}", "tools") from e
    _check_tools(key)
    return raw


@functools.lru_cache(maxsize=256)  # agents send the same tools on every call; a schema is checked once
def _check_tools(key: str) -> None:
    from jsonschema import SchemaError, validators

    raw = json.loads(key)
    for i, t in enumerate(raw):
        fn = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _bad(f"tools[{i}]: expected {{'type': 'function', 'function': {{'name': ..., 'parameters': ...}}}}",
                       f"tools[{i}]", "invalid_tool")  # fmt: skip
        params = fn.get("parameters", {"type": "object", "properties": {}})
        try:
            if not isinstance(params, dict):
                raise SchemaError(f"{params!r} is not an object")
            validators.validator_for(params).check_schema(params)
        except SchemaError as e:
            raise _bad(f"tools[{i}].function.parameters is not a valid JSON Schema: {e.message}",
                       f"tools[{i}].function.parameters", "invalid_tool_schema") from e  # fmt: skip


def _tool_choice(v: Any, tools: list[dict] | None) -> str | None:
    if v is None or v in ("auto", "required", "none"):
        return v
    name = v.get("function", {}).get("name") if isinstance(v, dict) and v.get("type") == "function" else None
    if not isinstance(name, str):
        raise _bad("tool_choice must be 'auto', 'none', 'required' or {'type': 'function', 'function': {'name'}}",
                   "tool_choice")  # fmt: skip
    if name not in {t["function"]["name"] for t in tools or []}:
        raise _bad(f"tool_choice names {name!r}, which is not in 'tools'", "tool_choice")
    return name


def _number(body: dict, key: str, lo: float, hi: float) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise _bad(f"'{key}' must be a number in [{lo}, {hi}], got {v!r}", key)
    return float(v)


def parse_request(body: Any, models: tuple[str, ...]) -> ChatRequest:
    """Validate a chat completion request body; raises RequestError with the offending param."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    unknown = sorted(set(body) - _KNOWN)
    if unknown:
        raise _bad(f"unrecognized request argument(s): {unknown}", unknown[0], "unknown_parameter")
    if body.get("model") not in models:
        raise RequestError(404, f"The model {body.get('model')!r} does not exist; this endpoint serves {list(models)}",
                           "model", "model_not_found")  # fmt: skip
    if body.get("n", 1) != 1:
        raise _bad("only n=1 is supported", "n")
    if body.get("top_logprobs"):
        raise _bad("top_logprobs is not supported (the engine returns the sampled token's log-prob only)",
                   "top_logprobs")  # fmt: skip
    tools = _tools(body.get("tools"))
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) for s in stop):
        raise _bad("'stop' must be a string or an array of up to 4 strings", "stop")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise _bad(f"max_tokens must be a positive integer, got {max_tokens!r}", "max_tokens")
    sampling = {k: v for k in ("temperature", "top_p")
                if (v := _number(body, k, 0.0 if k == "temperature" else 1e-9, 2.0 if k == "temperature" else 1.0))
                is not None}  # fmt: skip
    seed = body.get("seed")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise _bad(f"seed must be an integer, got {seed!r}", "seed")
        sampling["seed"] = seed
    opts = body.get("stream_options") or {}
    return ChatRequest(
        model=body["model"], messages=_messages(body.get("messages")), tools=tools,
        tool_choice=_tool_choice(body.get("tool_choice"), tools), max_tokens=max_tokens, stop=stop,
        logprobs=bool(body.get("logprobs")), stream=bool(body.get("stream")),
        include_usage=bool(isinstance(opts, dict) and opts.get("include_usage")), sampling=sampling,
    )  # fmt: skip


def _calls(reply: Reply, stream: bool) -> list[dict]:
    return [{**({"index": i} if stream else {}), "id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
            for i, c in enumerate(reply.message.tool_calls)]  # fmt: skip


def _logprobs(reply: Reply, tokenizer: Any) -> dict:
    raw = token_bytes(tokenizer, reply.token_ids)
    return {"content": [{"token": b.decode("utf-8", "replace"), "logprob": lp, "bytes": list(b), "top_logprobs": []}
                        for b, lp in zip(raw, reply.logprobs)]}  # fmt: skip


def token_bytes(tokenizer: Any, ids: list[int]) -> list[bytes]:
    """Each token's own bytes (what OpenAI's logprobs report), not its vocabulary symbol: byte-level BPE
    writes " café" as 'Ġcaf' 'Ã' '©', SentencePiece as '▁caf' '<0xC3>' '<0xA9>'."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_level = type(getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)).__name__ == "ByteLevel"
    to_byte = {c: b for b, c in bytes_to_unicode().items()}
    out = []
    for tok in tokenizer.convert_ids_to_tokens(ids):
        if byte_level and all(c in to_byte for c in tok):
            out.append(bytes(to_byte[c] for c in tok))
        elif not byte_level and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", tok):
            out.append(bytes([int(tok[3:5], 16)]))
        else:
            out.append((tok if byte_level else tok.replace("\u2581", " ")).encode())
    return out


def _usage(reply: Reply) -> dict:
    n = len(reply.token_ids)
    return {"prompt_tokens": reply.prompt_tokens, "completion_tokens": n, "total_tokens": reply.prompt_tokens + n}


def completion_body(reply: Reply, req: ChatRequest, cid: str, tokenizer: Any) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": reply.message.content or None, "refusal": None}
    if reply.message.reasoning_content:  # the field vLLM and SGLang's reasoning parsers fill
        msg["reasoning_content"] = reply.message.reasoning_content
    if reply.message.tool_calls:
        msg["tool_calls"] = _calls(reply, stream=False)
    choice = {"index": 0, "message": msg, "finish_reason": reply.finish_reason,
              "logprobs": _logprobs(reply, tokenizer) if req.logprobs else None}  # fmt: skip
    return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": req.model,
            "choices": [choice], "usage": _usage(reply)}  # fmt: skip


class StreamText:
    """Which part of a reply's text may already be sent as `delta.reasoning_content` / `delta.content` while
    tokens arrive.

    Sent text must be a prefix of the final message's field, so it holds back: an incomplete UTF-8 character
    at the end, anything from a (possible) stop string on, and, when tool calls are parsed, anything from a
    (possible) tool-call start on plus surrounding whitespace (the parsers strip it). A format whose calls
    have no start marker to watch for (or an unknown parser) holds everything back until the end, and so
    does harmony (its channels decide what is reasoning). Reasoning in ``<think>`` streams as it comes; the
    content after ``</think>``. `opened`: the generation prompt ended inside ``<think>`` (DeepSeek V3.1,
    Qwen3-Thinking-2507), so the reply starts as reasoning. `final(content, reasoning)` returns the rest."""

    def __init__(self, tokenizer: Any, parser: Any, stop: list[str], hold_all: bool = False,
                 reasoning_parser: Any = None, opened: bool = False) -> None:  # fmt: skip
        """`parser`: the tool-call parser when this reply's calls are parsed, else None; `reasoning_parser`: the
        endpoint's parser, whose format says how reasoning is written (None: no reasoning)."""
        self.tokenizer, self.parser, self.stop, self.hold_all = tokenizer, parser, stop, hold_all
        self.parser_name = getattr(parser, "name", "?") if parser is not None else None
        style = getattr(reasoning_parser, "reasoning_style", "think") if reasoning_parser is not None else None
        if style == "harmony":
            self.hold_all = True
        self.think = style == "think" and getattr(reasoning_parser, "name", "") not in ("llama3_json", "mistral")
        self.opened = opened
        self.ids: list[int] = []
        self.sent, self.sent_reasoning = "", ""
        self.decode_parser = parser or reasoning_parser

    def push(self, ids: list[int]) -> list[tuple[str, str]]:
        """Add generated ids; returns the (field, text) deltas that can be sent now (field: reasoning_content
        or content)."""
        self.ids += ids
        if self.hold_all:
            return []
        text = decode_reply(self.tokenizer, self.ids, self.decode_parser)
        end = len(text.rstrip("\ufffd"))
        for s in self.stop:
            end = min(end, _hold(text, s, end))
        text = text[:end]
        out: list[tuple[str, str]] = []
        if self.think:
            thinking, text = self._reasoning(text)
            if thinking is not None and thinking.startswith(self.sent_reasoning) and len(thinking) > len(self.sent_reasoning):
                out.append(("reasoning_content", thinking[len(self.sent_reasoning):]))
                self.sent_reasoning = thinking
            if text is None:
                return out
        if self.parser_name is not None:
            target = text[:_call_start(self.parser_name, text)].strip()
        else:
            target = text.lstrip() if self.sent_reasoning or self.opened else text
        if len(target) > len(self.sent) and target.startswith(self.sent):
            out.append(("content", target[len(self.sent):]))
            self.sent = target
        return out

    def _reasoning(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning that may be sent, text after the reasoning); None for what is not known yet."""
        body = text.lstrip()
        if not self.opened:
            if THINK_OPEN.startswith(body):  # "", "<", "<th": a block may be opening
                return None, None
            if not body.startswith(THINK_OPEN):
                return None, text
            body = body[len(THINK_OPEN):]
        close = body.find(THINK_CLOSE)
        if close >= 0:
            return body[:close].strip(), body[close + len(THINK_CLOSE):]
        held = body[: _hold(body, THINK_CLOSE, len(body))]
        return held.strip(), None

    def final(self, content: str, reasoning: str | None = None) -> list[tuple[str, str]]:
        """The deltas that complete the reply once it is known: the rest of its reasoning and of its content."""
        out = []
        reasoning = reasoning or ""
        if not reasoning.startswith(self.sent_reasoning) or not content.startswith(self.sent):
            # would mean decode(ids[:k]) is not a prefix of decode(ids)
            raise AssertionError(f"streamed {self.sent_reasoning!r} / {self.sent!r} are not prefixes of the reply's "
                                 f"reasoning {reasoning!r} / content {content!r}")
        if reasoning[len(self.sent_reasoning):]:
            out.append(("reasoning_content", reasoning[len(self.sent_reasoning):]))
        if content[len(self.sent):]:
            out.append(("content", content[len(self.sent):]))
        return out


def _hold(text: str, marker: str, end: int) -> int:
    """Index where `marker` starts in text[:end], or where a partial `marker` at its end starts (else end)."""
    i = text.find(marker, 0, end)
    if i >= 0:
        return i
    for k in range(min(len(marker) - 1, end), 0, -1):
        if text.endswith(marker[:k], 0, end):
            return end - k
    return end


# where each format's calls start (text before it may stream as content); Llama 4's list is found below
_CALL_MARKERS = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]", "qwen3_coder": "<tool_call>", "glm45": "<tool_call>",
                 "deepseek": "<｜tool▁calls▁begin｜>", "kimi_k2": "<|tool_calls_section_begin|>"}


def _call_start(parser_name: str, text: str) -> int:
    if parser_name in _CALL_MARKERS:
        return _hold(text, _CALL_MARKERS[parser_name], len(text))
    if parser_name == "llama3_json":  # the whole message is the call when it starts with '{'
        body = text.lstrip()
        return 0 if not body or body[0] in "{<" else len(text)
    if parser_name == "llama4_pythonic":  # calls may follow text: hold from any '[' on (or <|python_start|>)
        return min(_hold(text, "[", len(text)), _hold(text, "<|python_start|>", len(text)))
    return 0


# Text that forces the model into a tool call (`tool_choice: "required"` or a named function), per format.
_FORCED = {"hermes": ('<tool_call>\n', '<tool_call>\n{{"name": "{name}", "arguments": '),
           "mistral": ("[TOOL_CALLS]", '[TOOL_CALLS][{{"name": "{name}", "arguments": '),
           "llama3_json": ('{{"name": "', '{{"name": "{name}", "parameters": ')}  # fmt: skip


def forced_prefix(parser_name: str | None, tool_choice: str | None) -> str | None:
    """The text the reply is made to start with so that it is a call (of function `tool_choice` if named)."""
    if tool_choice in (None, "auto", "none") or parser_name not in _FORCED:
        return None
    required, named = _FORCED[parser_name]
    return required if tool_choice == "required" else named.format(name=tool_choice)


def _event(head: dict, delta: dict, finish: str | None = None, logprobs: Any = None) -> bytes:
    choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    return b"data: " + json.dumps({**head, "choices": [choice]}, ensure_ascii=False).encode() + b"\n\n"


def chunk_head(req: ChatRequest, cid: str) -> dict[str, Any]:
    return {"id": cid, "object": "chat.completion.chunk", "created": int(time.time()), "model": req.model}


def role_chunk(head: dict) -> bytes:
    """The first event: the role, before any content (as OpenAI sends it)."""
    return _event(head, {"role": "assistant", "content": ""})


def content_chunk(head: dict, text: str) -> bytes:
    return _event(head, {"content": text})


def delta_chunk(head: dict, field: str, text: str) -> bytes:
    """A `content` or `reasoning_content` delta."""
    return _event(head, {field: text})


def final_chunks(reply: Reply, req: ChatRequest, head: dict, rest: list[tuple[str, str]], tokenizer: Any
                 ) -> list[bytes]:  # fmt: skip
    """What follows the streamed deltas: the rest of the reasoning and content (`StreamText.final`), the tool calls (a
    header with id and name, then the arguments), the log-probs of the whole reply, the finish chunk, usage if
    asked, and `[DONE]`."""
    events = [delta_chunk(head, field, text) for field, text in rest]
    for c in _calls(reply, stream=True):
        fn = c["function"]
        events.append(_event(head, {"tool_calls": [{**c, "function": {"name": fn["name"], "arguments": ""}}]}))
        events.append(_event(head, {"tool_calls": [{"index": c["index"], "function": {"arguments": fn["arguments"]}}]}))
    lps = _logprobs(reply, tokenizer) if req.logprobs else None
    events.append(_event(head, {}, reply.finish_reason, lps))
    if req.include_usage:
        events.append(b"data: " + json.dumps({**head, "choices": [], "usage": _usage(reply)}).encode() + b"\n\n")
    return [*events, b"data: [DONE]\n\n"]
