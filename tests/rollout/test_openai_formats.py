"""Every format on the OpenAI endpoint path: replies streamed token by token (markers split over many tokens of
the tiny tokenizer) send content and `reasoning_content` deltas that add up to the parsed reply, never text
that later turns out to be a call or reasoning; the non-streamed body carries `reasoning_content`."""

from __future__ import annotations

import pytest
from test_formats import FAMILIES, TOOLS, _calls, _reply

from verl_agent.parsers import get_parser
from verl_agent.protocol import Message
from verl_agent.rollout.openai.openai_wire import ChatRequest, StreamText, completion_body
from verl_agent.rollout.openai.recorder import Reply


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


def _stream(tok, parser, text: str, opened: bool = False) -> tuple[dict[str, str], Message]:
    ids = tok.encode(text, add_special_tokens=False)
    stream = StreamText(tok, parser, [], reasoning_parser=parser, opened=opened)
    got = {"content": "", "reasoning_content": ""}
    for i in ids:
        for field, delta in stream.push([i]):
            got[field] += delta
    parsed = parser.parse(tok.decode(ids), TOOLS)
    reply = Message(role="assistant", content=parsed.content, reasoning_content=parsed.reasoning or None)
    for field, delta in stream.final(reply.content, reply.reasoning_content):
        got[field] += delta
    return got, reply


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_streamed_deltas_add_up_to_the_parsed_reply(tok, family: str) -> None:
    text = _reply(tok, family, Message(role="assistant", content="Checking both.", tool_calls=_calls(family),
                                       reasoning_content="Two lookups."))  # fmt: skip
    got, reply = _stream(tok, get_parser(FAMILIES[family]), text)
    assert got == {"content": reply.content, "reasoning_content": reply.reasoning_content or ""}


def test_reasoning_streams_before_the_answer_and_a_prompt_may_open_it(tok) -> None:
    parser = get_parser("hermes")
    text = "<think>\nadd the numbers\n</think>\n\nIt is 4."
    ids = tok.encode(text, add_special_tokens=False)
    stream = StreamText(tok, parser, [], reasoning_parser=parser)
    deltas = [d for i in ids for d in stream.push([i])]
    fields = [f for f, _ in deltas]
    assert "reasoning_content" in fields and fields.index("content") > max(
        k for k, f in enumerate(fields) if f == "reasoning_content")  # reasoning first, then the answer
    assert "".join(t for f, t in deltas if f == "reasoning_content") == "add the numbers"
    got, _ = _stream(tok, parser, "add the numbers\n</think>\n\nIt is 4.", opened=True)
    assert got == {"content": "It is 4.", "reasoning_content": "add the numbers"}


def test_completion_body_carries_reasoning_content(tok) -> None:
    msg = Message(role="assistant", content="It is 4.", reasoning_content="add")
    reply = Reply(msg, "stop", [1, 2], [0.0, 0.0], 5, [])
    body = completion_body(reply, ChatRequest(model="policy", messages=[]), "c1", tok)
    assert body["choices"][0]["message"]["reasoning_content"] == "add"
    assert body["choices"][0]["message"]["content"] == "It is 4."
