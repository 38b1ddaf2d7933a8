"""Tool-call parsers on messy, real-world-looking model outputs."""

from __future__ import annotations

import json

import pytest

from verl_agent.parsers import FORMATS, detect_format, get_parser
from verl_agent.protocol import ToolCall


class _Vocab:
    """Just the `get_vocab` face of a tokenizer (detection reads nothing else)."""

    def __init__(self, *tokens: str) -> None:
        self.vocab = {t: i for i, t in enumerate(tokens)}

    def get_vocab(self) -> dict[str, int]:
        return self.vocab


# ---- hermes / qwen ---------------------------------------------------------------------------

def test_hermes_single_call_with_whitespace_and_eos() -> None:
    text = '  <tool_call>\n  {"name": "calculator", "arguments": {"expression": "37 * 12 + 5"}}  \n</tool_call><|im_end|>'
    r = get_parser("hermes").parse(text)
    assert r.tool_calls == [ToolCall("calculator", {"expression": "37 * 12 + 5"})]
    assert r.content == "" and r.errors == []


def test_hermes_several_calls_content_and_trailing_text() -> None:
    text = (
        "Let me look both up.\n<tool_call>\n{\"name\": \"search\", \"arguments\": {\"q\": \"a\"}}\n</tool_call>\n"
        "<tool_call>{\"name\": \"search\", \"arguments\": {\"q\": \"b\", \"opts\": {\"k\": [1, 2], \"deep\": true}}}"
        "</tool_call>\nI'll wait."
    )
    r = get_parser("qwen2_5").parse(text)
    assert [c.arguments for c in r.tool_calls] == [{"q": "a"}, {"q": "b", "opts": {"k": [1, 2], "deep": True}}]
    assert r.content == "Let me look both up.\nI'll wait."
    assert r.errors == []


def test_hermes_end_tag_inside_an_argument_and_two_objects_in_one_block() -> None:
    """The JSON decides where a call ends: '</tool_call>' inside a string argument is text, not the end tag;
    a block holding two objects is two calls."""
    code = 'print("</tool_call>")'
    call = json.dumps({"name": "python", "arguments": {"code": code}})
    text = (f'<tool_call>{call}</tool_call> after '
            '<tool_call>{"name": "a", "arguments": {}}\n{"name": "b", "arguments": {"x": 1}}</tool_call>')
    r = get_parser("hermes").parse(text)
    assert r.tool_calls == [ToolCall("python", {"code": code}), ToolCall("a", {}), ToolCall("b", {"x": 1})]
    assert r.content == "after" and r.errors == []


def test_hermes_arguments_as_json_string_and_parameters_key() -> None:
    text = ('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>'
            '<tool_call>{"name": "g", "parameters": {"y": "2"}}</tool_call>')
    r = get_parser("hermes").parse(text)
    assert r.tool_calls == [ToolCall("f", {"x": 1}), ToolCall("g", {"y": "2"})]


def test_hermes_bad_json_is_an_error_that_keeps_text_and_other_calls_survive() -> None:
    text = ('<tool_call>{"name": "f", "arguments": {"x": 1,}}</tool_call>'
            '<tool_call>{"name": "g", "arguments": {}}</tool_call>')
    r = get_parser("hermes").parse(text)
    assert r.tool_calls == [ToolCall("g", {})]
    assert len(r.errors) == 1 and "invalid JSON" in r.errors[0] and '{"x": 1,}' in r.errors[0]


def test_hermes_unclosed_tag_partial_json() -> None:
    text = 'Sure.\n<tool_call>\n{"name": "calculator", "arguments": {"expre'
    r = get_parser("hermes").parse(text)
    assert r.tool_calls == [] and r.content == "Sure."
    assert len(r.errors) == 1 and "unclosed <tool_call>" in r.errors[0] and '"expre' in r.errors[0]


@pytest.mark.parametrize(
    "body, needle",
    [('{"arguments": {}}', "missing or non-string 'name'"),
     ('{"name": "f", "arguments": [1, 2]}', "must be a JSON object"),
     ('{"name": "f", "arguments": "not json"}', "not valid JSON"),
     ('[1, 2]', "expected a JSON object")],
)
def test_hermes_wrong_shapes_are_errors(body: str, needle: str) -> None:
    r = get_parser("hermes").parse(f"<tool_call>{body}</tool_call>")
    assert r.tool_calls == [] and len(r.errors) == 1 and needle in r.errors[0]


def test_hermes_plain_answer() -> None:
    r = get_parser("hermes").parse("The answer is 449.<|im_end|>")
    assert (r.content, r.tool_calls, r.errors) == ("The answer is 449.", [], [])


# ---- llama 3 json ----------------------------------------------------------------------------

def test_llama3_json_call_with_python_tag_and_eot() -> None:
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}<|eom_id|>'
    r = get_parser("llama3_json").parse(text)
    assert r.tool_calls == [ToolCall("get_weather", {"city": "Paris", "days": 3})] and r.errors == []


def test_llama3_json_several_calls_separated_by_semicolon() -> None:
    text = ' {"name": "a", "parameters": {}}; {"name": "b", "arguments": "{\\"z\\": [1]}"}\n'
    r = get_parser("llama3").parse(text)
    assert r.tool_calls == [ToolCall("a", {}), ToolCall("b", {"z": [1]})]


def test_llama3_json_plain_text_and_json_looking_answers_stay_content() -> None:
    p = get_parser("llama3_json")
    assert p.parse("The answer is 4.<|eot_id|>").content == "The answer is 4."
    r = p.parse('{"result": 4}')  # JSON without a name is an answer, not a call
    assert r.tool_calls == [] and r.errors == [] and r.content == '{"result": 4}'


def test_llama3_json_partial_json_is_error() -> None:
    r = get_parser("llama3_json").parse('{"name": "a", "parameters": {"x": 1}}; {"name": "b", "param')
    assert r.tool_calls == [ToolCall("a", {"x": 1})]
    assert len(r.errors) == 1 and '"param' in r.errors[0]
    r = get_parser("llama3_json").parse('<|python_tag|>{"name": "a", "parame')
    assert r.tool_calls == [] and "partial JSON" in r.errors[0]


# ---- mistral ---------------------------------------------------------------------------------

def test_mistral_v3_list_with_ids() -> None:
    text = 'Checking.[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}, "id": "abc123xyz"}, {"name": "g", "arguments": {}}]</s>'
    r = get_parser("mistral").parse(text)
    assert r.content == "Checking."
    assert r.tool_calls == [ToolCall("f", {"a": 1}, id="abc123xyz"), ToolCall("g", {})]


def test_mistral_args_form_and_bad_json() -> None:
    r = get_parser("mistral").parse('[TOOL_CALLS]f[ARGS]{"a": {"b": 2}}[TOOL_CALLS]g[ARGS]{"oops"')
    assert r.tool_calls == [ToolCall("f", {"a": {"b": 2}})]
    assert len(r.errors) == 1 and "'g'" in r.errors[0] and '{"oops"' in r.errors[0]
    r = get_parser("mistral").parse('[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}')
    assert r.tool_calls == [] and "partial JSON" in r.errors[0]


# ---- selection -------------------------------------------------------------------------------

def test_mistral_call_id_form() -> None:
    """v13+ templates put the call id between the name and the arguments: name[CALL_ID]id[ARGS]{...}."""
    r = get_parser("mistral").parse('[TOOL_CALLS]search[CALL_ID]abc123456[ARGS]{"q": "x"}')
    assert r.tool_calls == [ToolCall("search", {"q": "x"}, id="abc123456")] and r.errors == []


def test_detect_and_get_parser() -> None:
    assert detect_format(_Vocab("<tool_call>", "<|im_end|>")) == "hermes"
    assert detect_format(_Vocab("[TOOL_CALLS]", "</s>")) == "mistral"
    assert detect_format(_Vocab("<|python_tag|>", "<|eot_id|>")) == "llama3_json"
    assert detect_format(_Vocab("hello")) == "hermes"
    assert get_parser(None, _Vocab("[TOOL_CALLS]")).name == "mistral"
    assert set(FORMATS) == {"hermes", "llama3_json", "mistral", "qwen3_coder", "glm45", "deepseek", "kimi_k2",
                            "harmony", "llama4_pythonic"}
    assert detect_format(_Vocab("<|channel|>", "<|message|>", "<|end|>")) == "harmony"
    assert detect_format(_Vocab("<｜tool▁calls▁begin｜>")) == "deepseek"
    assert detect_format(_Vocab("<|tool_calls_section_begin|>", "<|im_end|>")) == "kimi_k2"
    with pytest.raises(ValueError, match="unknown tool-call format 'xml'.*hermes"):
        get_parser("xml")


def test_detect_from_tiny_tokenizer(tiny_model_path) -> None:
    from transformers import AutoTokenizer

    assert get_parser(None, AutoTokenizer.from_pretrained(tiny_model_path)).name == "hermes"


def test_tool_call_markers_that_are_special_tokens_reach_the_parser(tiny_model_path) -> None:
    """Mistral tokenizers mark [TOOL_CALLS] / [ARGS] special: decoding with skip_special_tokens alone hides
    every call. decode_reply keeps the parser's markers and still drops the other special tokens."""
    from transformers import AutoTokenizer

    from verl_agent.parsers import decode_reply

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "[ARGS]"]})
    ids = tok.encode('Looking.[TOOL_CALLS]search[ARGS]{"q": "x"}', add_special_tokens=False) + [tok.eos_token_id]
    assert "[TOOL_CALLS]" not in tok.decode(ids, skip_special_tokens=True)  # the defect this guards against
    mistral = get_parser("mistral", tok)
    text = decode_reply(tok, ids, mistral)
    assert text == 'Looking.[TOOL_CALLS]search[ARGS]{"q": "x"}'  # eos dropped, markers kept
    assert mistral.parse(text).tool_calls == [ToolCall("search", {"q": "x"})]
    hermes = get_parser("hermes", tok)  # the tiny tokenizer keeps <tool_call> anyway: plain decoding
    assert hermes.hidden_markers == {} and decode_reply(tok, ids, hermes) == tok.decode(ids, skip_special_tokens=True)
