"""Every tool-call family: round trip through a template written to its documented format, several calls,
malformed calls, typed arguments, reasoning, and detection from the template.

The templates are tests/fixtures/templates/<family>.jinja; each one's header says where its format is
documented. Rendering goes through Hugging Face's own `apply_chat_template` (the tiny model's tokenizer).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from verl_agent.formats.detect import format_from_template
from verl_agent.parsers import FORMATS, get_parser, split_reasoning
from verl_agent.protocol import Message, ToolCall

TEMPLATES = Path(__file__).parent / "fixtures" / "templates"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "hours": {"type": "array", "items": {"type": "integer"}}, "ratio": {"type": ["number", "null"]}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string"}}}}}]  # fmt: skip
# the fixture of each family -> the parser name detection must give
FAMILIES = {"qwen3_think": "hermes", "qwen3_coder": "qwen3_coder", "glm45": "glm45", "deepseek_v31": "deepseek",
            "kimi_k2": "kimi_k2", "harmony": "harmony", "llama4_pythonic": "llama4_pythonic"}


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


def _render(tok, template: str, messages: list[Message], gen: bool) -> str:
    return tok.apply_chat_template([m.to_chat() for m in messages], tools=TOOLS, chat_template=template,
                                   add_generation_prompt=gen, tokenize=False)  # fmt: skip


def _reply(tok, family: str, reply: Message) -> str:
    """What a model trained on `family`'s template generates for `reply`: its rendering after the prompt."""
    template = (TEMPLATES / f"{family}.jinja").read_text()
    history = [Message(role="user", content="Weather in Paris and the time?")]
    prompt = _render(tok, template, history, gen=True)
    full = _render(tok, template, [*history, reply], gen=False)
    assert full.startswith(prompt), family
    return full[len(prompt):]


def _calls(family: str) -> list[ToolCall]:
    ids = ["functions.get_weather:0", "functions.get_time:1"] if family == "kimi_k2" else ["", ""]
    return [ToolCall("get_weather", {"city": "Paris", "days": 3, "metric": True, "hours": [9, 18], "ratio": 0.5}, ids[0]),
            ToolCall("get_time", {"zone": "CET"}, ids[1])]  # fmt: skip


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_round_trip_two_typed_calls_with_text_and_reasoning(tok, family: str) -> None:
    """Render two calls (every JSON type among their arguments) with the family's template, parse them back: the
    same calls, typed by the tools' schema where the format writes strings (Qwen3-Coder, GLM-4.5)."""
    thinks = family in ("qwen3_think", "glm45", "harmony")
    reply = Message(role="assistant", content="Checking both.", tool_calls=_calls(family),
                    reasoning_content="Two lookups are needed." if thinks else None)
    text = _reply(tok, family, reply)
    parsed = get_parser(FAMILIES[family]).parse(text, TOOLS)
    assert parsed.errors == []
    assert parsed.tool_calls == _calls(family)
    if family != "llama4_pythonic":  # its calls are the whole message
        assert parsed.content == "Checking both."
    assert parsed.reasoning == ("Two lookups are needed." if thinks else "")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_template_names_its_format(family: str) -> None:
    assert format_from_template((TEMPLATES / f"{family}.jinja").read_text()) == FAMILIES[family]


def test_detection_falls_back_to_the_vocabulary_and_to_hermes() -> None:
    assert format_from_template("{{ messages[0].content }}") is None
    assert format_from_template((TEMPLATES / "llama3_style.jinja").read_text()) in (None, "llama3_json")
    assert set(FAMILIES.values()) <= set(FORMATS)


MALFORMED = [
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>",
     "<parameter=city> of 'get_weather' is not closed"),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n</function>\n</tool_call>",
     "parameter 'days' of 'get_weather' must be integer, got 'three'"),
    ("qwen3_coder", "<tool_call>\n<parameter=days>\n3\n</parameter>\n</tool_call>", "no <function=NAME>"),
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n</tool_call>", "unpaired or unclosed"),
    ("glm45", "<tool_call>get_weather\n<arg_key>metric</arg_key><arg_value>maybe</arg_value>\n</tool_call>",
     "parameter 'metric' of 'get_weather' must be boolean"),
    ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key><arg_value>Paris</arg_value>", "unclosed <tool_call>"),
    ("deepseek", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": <｜tool▁call▁end｜>"
     "<｜tool▁calls▁end｜>", "arguments of 'get_weather' are not one JSON object"),
    ("deepseek", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
     "no <｜tool▁sep｜>"),
    ("deepseek", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{}", "unclosed <｜tool▁calls▁begin｜>"),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>get_weather<|tool_call_argument_begin|>{}"
     "<|tool_call_end|><|tool_calls_section_end|>", "expected functions.NAME:INDEX"),
    ("kimi_k2", "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
     "[1]<|tool_call_end|><|tool_calls_section_end|>", "must be a JSON object"),
    ("harmony", "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Par",
     "arguments of 'get_weather' are not one JSON object"),
    ("harmony", "<|channel|>commentary to=functions.get_weather json{\"city\": 1}<|call|>", "no <|message|>"),
    ("llama4_pythonic", "[get_weather(city=\"Paris\"", "not a Python list of calls"),
    ("llama4_pythonic", "[get_weather(\"Paris\")]", "keyword arguments only"),
    ("llama4_pythonic", "[get_weather(city=somewhere)]", "is not a literal"),
]


@pytest.mark.parametrize("fmt, text, needle", MALFORMED)
def test_malformed_calls_are_reported_with_their_text(fmt: str, text: str, needle: str) -> None:
    parsed = get_parser(fmt).parse(text, TOOLS)
    assert parsed.tool_calls == [] and len(parsed.errors) == 1, parsed
    assert needle in parsed.errors[0]


def test_one_malformed_call_leaves_the_others() -> None:
    text = ("<tool_call>get_time\n<arg_key>zone</arg_key>\n<arg_value>CET</arg_value>\n</tool_call>"
            "<tool_call>get_weather\n<arg_key>days</arg_key>\n<arg_value>soon</arg_value>\n</tool_call>")
    parsed = get_parser("glm45").parse(text, TOOLS)
    assert parsed.tool_calls == [ToolCall("get_time", {"zone": "CET"})]
    assert len(parsed.errors) == 1 and "'days'" in parsed.errors[0] and "soon" in parsed.errors[0]


def test_string_arguments_without_a_schema_read_json_else_text() -> None:
    text = "<tool_call>\n<function=other>\n<parameter=n>\n7\n</parameter>\n<parameter=s>\nhi there\n</parameter>\n</function>\n</tool_call>"
    assert get_parser("qwen3_coder").parse(text).tool_calls == [ToolCall("other", {"n": 7, "s": "hi there"})]


def test_deepseek_v3_fenced_and_v32_dsml_forms() -> None:
    """V3-0324 / R1-0528 wrap the arguments in a json fence after 'function<sep>NAME'; V3.2 writes DSML tags
    (DeepSeek-V3.2's encoding folder on the hub) with string="true|false" per parameter."""
    p = get_parser("deepseek")
    v3 = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{\"zone\": \"CET\"}\n```"
          "<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
    assert p.parse(v3).tool_calls == [ToolCall("get_time", {"zone": "CET"})]
    dsml = ('<think>plan</think>Ok.<｜DSML｜function_calls>\n<｜DSML｜invoke name="get_weather">\n'
            '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
            '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>')
    parsed = p.parse(dsml)
    assert (parsed.tool_calls, parsed.content, parsed.reasoning) == ([ToolCall("get_weather", {"city": "Paris", "days": 3})],
                                                                      "Ok.", "plan")  # fmt: skip


def test_harmony_recipient_in_the_role_and_a_final_answer() -> None:
    p = get_parser("harmony")
    call = "<|channel|>analysis<|message|>Need time.<|end|><|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{\"zone\": \"CET\"}<|call|>"
    assert p.parse(call).tool_calls == [ToolCall("get_time", {"zone": "CET"})]
    final = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>It is 4.<|return|>"
    parsed = p.parse(final)
    assert (parsed.content, parsed.reasoning, parsed.tool_calls) == ("It is 4.", "Easy.", [])
    assert split_reasoning(p, final) == ("Easy.", "It is 4.")


def test_reasoning_opened_by_the_generation_prompt_and_cut_off() -> None:
    """DeepSeek V3.1 / Qwen3-Thinking-2507 open <think> in the prompt: only </think> is generated."""
    hermes = get_parser("hermes")
    parsed = hermes.parse('I should add.\n</think>\n\n<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    assert (parsed.reasoning, parsed.content, parsed.tool_calls) == ("I should add.", "", [ToolCall("get_time", {})])
    assert hermes.parse("<think>still thinking when the budget ran o").reasoning == "still thinking when the budget ran o"
    assert split_reasoning(hermes, "plain answer") == ("", "plain answer")
    assert split_reasoning(get_parser("mistral"), "<think>x</think>y") == ("", "<think>x</think>y")


def test_plain_answers_are_content_for_every_format() -> None:
    for fmt in FORMATS:
        parsed = get_parser(fmt).parse("The answer is [4].", TOOLS)
        assert (parsed.content, parsed.tool_calls, parsed.errors) == ("The answer is [4].", [], []), fmt
