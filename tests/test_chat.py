"""Token-exact incremental chat encoding, checked against full-template encodings.

Templates: the tiny model's own, plus Qwen-style and Llama-3-style templates
written as fixtures (tests/fixtures/templates), all on the tiny model's real
tokenizer (a template is just a string on the tokenizer).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from verl_agent.chat import ChatEncoder, ChatTemplateError
from verl_agent.protocol import Message, ToolCall

FIXTURES = Path(__file__).parent / "fixtures" / "templates"
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                  "<|python_tag|>"]
TOOLS = [
    {"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
     "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}},
    {"type": "function", "function": {"name": "search", "description": "Search the web, déjà vu.",
     "parameters": {"type": "object", "properties": {"query": {"type": "string"},
                    "filters": {"type": "object", "properties": {"year": {"type": "integer"}}},
                    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}}},
                    "required": ["query"]}}},
]
_WORDS = ["The", "answer", "is", "449", " ", "\n", "  spaced  ", "ünïcode", "日本語", "{\"json\": 1}", "x*y", "3.14",
          "<b>tag</b>", "emoji 🎉", "tabs\tand", "end.", "?", "\n\n"]


def _tokenizer(path: Path, template: str):
    tok = AutoTokenizer.from_pretrained(path)
    if template == "tiny":
        return tok
    if template == "llama3":
        tok.add_special_tokens({"additional_special_tokens": LLAMA_SPECIALS})
        tok.bos_token, tok.eos_token = "<|begin_of_text|>", "<|eot_id|>"
    tok.chat_template = (FIXTURES / f"{template}_style.jinja").read_text()
    return tok


def _text(rng: random.Random) -> str:
    return "".join(rng.choice(_WORDS) + rng.choice(["", " "]) for _ in range(rng.randint(1, 8))).strip() or "ok"


def _conversation(rng: random.Random) -> list[Message]:
    """Random chat: [system] user, then rounds of assistant (text and/or calls) + tool results / user feedback."""
    msgs = [Message("system", _text(rng))] if rng.random() < 0.5 else []
    msgs.append(Message("user", _text(rng)))
    for _ in range(rng.randint(1, 4)):
        calls = [ToolCall(rng.choice(["calculator", "search"]),
                          {"expression": _text(rng), "nested": {"k": [1, rng.randint(0, 999)], "ok": True}})
                 for _ in range(rng.choice([0, 0, 1, 2, 3]))]
        content = _text(rng) if not calls or rng.random() < 0.3 else ""
        msgs.append(Message("assistant", content, calls))
        if calls:
            msgs += [Message("tool", _text(rng), name=c.name) for c in calls]
        else:
            msgs.append(Message("user", _text(rng)))
    msgs.append(Message("assistant", _text(rng)))
    return msgs


def _check_incremental(enc: ChatEncoder, msgs: list[Message]) -> int:
    """Build ids turn by turn; after every observation they must equal the full encoding. Returns turns checked."""
    first = next(i for i, m in enumerate(msgs) if m.role == "assistant")
    ids = enc.encode_prompt(msgs[:first])
    assert ids == enc.encode_text(enc.render(msgs[:first], add_generation_prompt=True))
    i, checked = first, 0
    while i < len(msgs):
        gen = enc.encode_assistant(msgs[:i], msgs[i])
        assert gen[-1] in enc.eos_token_ids
        ids = ids + gen
        j = i + 1
        while j < len(msgs) and msgs[j].role != "assistant":
            j += 1
        if j == i + 1:  # the conversation ends with this assistant turn
            full = enc.encode_text(enc.render(msgs, add_generation_prompt=False))
            assert full[: len(ids)] == ids
            closing = enc.tokenizer.decode(full[len(ids):])
            assert closing.strip() == "", closing  # only the template's closing whitespace remains
            return checked
        ids = ids + enc.encode_observation(msgs[: i + 1], msgs[i + 1 : j])
        assert ids == enc.encode_text(enc.render(msgs[:j], add_generation_prompt=True)), f"turn {checked}"
        checked += 1
        i = j
    return checked


@pytest.mark.parametrize("template", ["tiny", "qwen", "llama3"])
@pytest.mark.parametrize("with_tools", [True, False])
def test_incremental_equals_full_encoding(tiny_model_path: Path, template: str, with_tools: bool) -> None:
    tok = _tokenizer(tiny_model_path, template)
    enc = ChatEncoder(tok, tools=TOOLS if with_tools else None)
    rng = random.Random(f"{template}-{with_tools}")
    turns = sum(_check_incremental(enc, _conversation(rng)) for _ in range(25))
    assert turns >= 25  # several multi-turn conversations were really checked


def test_tools_are_rendered_by_the_template(tiny_model_path: Path) -> None:
    for template in ("tiny", "qwen", "llama3"):
        enc = ChatEncoder(_tokenizer(tiny_model_path, template), tools=TOOLS)
        text = enc.tokenizer.decode(enc.encode_prompt([Message("user", "hi")]))
        assert "calculator" in text and '"enum"' in text and "déjà vu" in text, template
        assert "calculator" not in enc.tokenizer.decode(ChatEncoder(enc.tokenizer).encode_prompt([Message("user", "hi")]))


def test_tiny_template_layout(tiny_model_path: Path) -> None:
    """The exact Qwen2.5-style text: tool call blocks and tool results as a user turn."""
    enc = ChatEncoder(_tokenizer(tiny_model_path, "tiny"))
    msgs = [Message("user", "What is 2 + 3?"),
            Message("assistant", "", [ToolCall("calculator", {"expression": "2 + 3"})]),
            Message("tool", "5"), Message("tool", "6")]
    text = enc.render(msgs, add_generation_prompt=True)
    assert text.endswith(
        "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n"
        '{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n6\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    obs = enc.encode_observation(msgs[:2], msgs[2:])
    assert enc.tokenizer.decode(obs) == ("\n<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n6"
                                         "\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_eos_token_ids(tiny_model_path: Path) -> None:
    tiny = ChatEncoder(_tokenizer(tiny_model_path, "tiny"))
    assert tiny.eos_token_ids == [tiny.tokenizer.convert_tokens_to_ids("<|im_end|>")]
    llama = ChatEncoder(_tokenizer(tiny_model_path, "llama3"))
    names = llama.tokenizer.convert_ids_to_tokens(llama.eos_token_ids)
    assert names[0] == "<|eot_id|>" and "<|eom_id|>" in names


def test_message_dicts_are_accepted(tiny_model_path: Path) -> None:
    enc = ChatEncoder(_tokenizer(tiny_model_path, "tiny"), tools=TOOLS)
    msgs = [Message("user", "hi"), Message("assistant", "", [ToolCall("search", {"query": "x"})])]
    as_dicts = [m.to_chat() for m in msgs]
    new = [Message("tool", json.dumps({"r": 1}))]
    assert enc.encode_observation(as_dicts, [m.to_chat() for m in new]) == enc.encode_observation(msgs, new)


# ---- templates that cannot be encoded incrementally ------------------------------------------

_UNSTABLE = (  # drops the reasoning of earlier assistant turns, like Qwen3's template
    "{%- for m in messages -%}<|im_start|>{{ m.role }}\n"
    "{%- if m.role == 'assistant' and not loop.last -%}{{ m.content.split('</think>')[-1] }}"
    "{%- else -%}{{ m.content }}{%- endif -%}<|im_end|>\n{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
)
_NO_EOT = ("{%- for m in messages -%}### {{ m.role }}: {{ m.content }}\n\n{%- endfor -%}"
           "{%- if add_generation_prompt -%}### assistant: {%- endif -%}")


def test_unstable_prefix_is_a_clear_error(tiny_model_path: Path) -> None:
    tok = _tokenizer(tiny_model_path, "tiny")
    tok.chat_template = _UNSTABLE
    enc = ChatEncoder(tok)
    hist = [Message("user", "q"), Message("assistant", "<think>hmm</think>4")]
    with pytest.raises(ChatTemplateError, match="not prefix-stable"):
        enc.encode_observation(hist, [Message("user", "why?")])


def test_missing_end_of_turn_token_is_a_clear_error(tiny_model_path: Path) -> None:
    tok = _tokenizer(tiny_model_path, "tiny")
    tok.chat_template = _NO_EOT
    with pytest.raises(ChatTemplateError, match="end-of-turn special token"):
        ChatEncoder(tok).encode_observation([Message("user", "q"), Message("assistant", "a")], [Message("user", "b")])


def test_bad_inputs(tiny_model_path: Path) -> None:
    tok = _tokenizer(tiny_model_path, "tiny")
    enc = ChatEncoder(tok)
    with pytest.raises(ValueError, match="must end with the assistant message"):
        enc.encode_observation([Message("user", "q")], [Message("user", "b")])
    with pytest.raises(ValueError, match="no new messages"):
        enc.encode_observation([Message("user", "q"), Message("assistant", "a")], [])
    with pytest.raises(TypeError, match="tools"):
        ChatEncoder(tok, tools=["calculator"])
    tok.chat_template = None
    with pytest.raises(ChatTemplateError, match="no chat_template"):
        ChatEncoder(tok)
