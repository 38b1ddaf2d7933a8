"""`stream=true` on the OpenAI endpoint: content deltas while the engine generates, OpenAI chunk shapes,
the official `openai` client's streaming; over the scripted engine (per-token pacing) and the tiny model."""

from __future__ import annotations

import json

import httpx
import pytest
from model_helpers import call_text, scripted_engine
from transformers import AutoTokenizer

from verl_agent.parsers import get_parser
from verl_agent.engine.contract import SamplingParams
from verl_agent.rollout.openai.openai_server import OpenAIServer

openai = pytest.importorskip("openai")

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
          "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]  # fmt: skip
USER = [{"role": "user", "content": "What is 12 * 37?"}]
PROSE = "Let me think about it: twelve times thirty-seven is 444, so the answer is 444."


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    return AutoTokenizer.from_pretrained(str(tiny_model_path))


async def _serve(engine, tok, **kw):
    server = OpenAIServer(engine, tok, get_parser("hermes"), **kw)
    await server.start()
    rec = server.open_session(SamplingParams(seed=3, temperature=0.0, max_new_tokens=64), uid="u0")
    client = openai.AsyncOpenAI(base_url=server.base_url(rec.sid), api_key=rec.sid, max_retries=0)
    return server, rec, client


async def test_content_streams_token_by_token_before_generation_ends(tok):
    engine = scripted_engine(tok, [PROSE], delay=0.4)  # 0.4 s spread over the reply's tokens
    server, rec, client = await _serve(engine, tok)
    n_tokens = len(engine.reply_ids(PROSE))
    stream = await client.chat.completions.create(model="policy", messages=USER, stream=True,
                                                  stream_options={"include_usage": True})  # fmt: skip
    chunks, calls_at_first_content = [], None
    async for c in stream:
        chunks.append(c)
        if calls_at_first_content is None and c.choices and c.choices[0].delta.content:
            calls_at_first_content = rec.counts["calls"]  # 0: the call is recorded only once generation ended
    assert calls_at_first_content == 0 and rec.counts["calls"] == 1
    first = chunks[0].choices[0]
    assert (first.delta.role, first.delta.content, first.finish_reason) == ("assistant", "", None)
    deltas = [c.choices[0].delta.content for c in chunks[1:] if c.choices and c.choices[0].delta.content]
    assert len(deltas) >= n_tokens // 2  # about one chunk per token (a batch when the client fell behind)
    assert "".join(deltas) == PROSE
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == n_tokens
    assert len({c.id for c in chunks}) == 1 and all(c.object == "chat.completion.chunk" for c in chunks)
    await client.close()
    await server.stop()


async def test_tool_call_stream_shape_and_sdk_accumulation(tok):
    reply = "I will use the calculator.\n" + call_text("calculator", '{"expression": "12*37"}')
    server, rec, client = await _serve(scripted_engine(tok, [reply], delay=0.1), tok)
    url = server.base_url(rec.sid)
    async with httpx.AsyncClient(base_url=url) as http:  # raw SSE: framing and exact chunk shapes
        r = await http.post("/chat/completions", json={"model": "policy", "messages": USER, "tools": TOOLS,
                                                       "stream": True, "logprobs": True})  # fmt: skip
    assert r.headers["content-type"].startswith("text/event-stream")
    events = r.text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""] and all(e.startswith("data: ") for e in events[:-1])
    body = [json.loads(e[6:]) for e in events[:-2]]
    deltas = [b["choices"][0]["delta"] for b in body]
    assert deltas[0] == {"role": "assistant", "content": ""}
    content = "".join(d.get("content") or "" for d in deltas)
    assert content == "I will use the calculator."  # nothing of the call leaked as content
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0] == {"index": 0, "id": calls[0]["id"], "type": "function",
                        "function": {"name": "calculator", "arguments": ""}}  # fmt: skip
    assert calls[0]["id"].startswith("call_") and all(c["index"] == 0 for c in calls)
    assert json.loads("".join(c["function"]["arguments"] for c in calls)) == {"expression": "12*37"}
    finish = body[-1]["choices"][0]
    assert finish["finish_reason"] == "tool_calls" and finish["delta"] == {}
    assert [x["logprob"] for x in finish["logprobs"]["content"]] == rec.segments[0].traj.rollout_logprobs
    assert all(b["choices"][0]["finish_reason"] is None for b in body[:-1])

    # the SDK's own accumulation of the stream gives the non-streamed message
    async with client.chat.completions.stream(model="policy", messages=[{"role": "user", "content": "again"}],
                                              tools=TOOLS) as s:  # fmt: skip
        final = await s.get_final_completion()
    full = await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "once more"}],
                                                tools=TOOLS)  # fmt: skip
    for got in (final, full):
        msg = got.choices[0].message
        assert (msg.content, got.choices[0].finish_reason) == ("I will use the calculator.", "tool_calls")
        assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
            ("calculator", {"expression": "12*37"})]
    await client.close()
    await server.stop()


async def test_stop_strings_and_errors_while_streaming(tok):
    server, rec, client = await _serve(scripted_engine(tok, [PROSE], delay=0.1), tok)
    stream = await client.chat.completions.create(model="policy", messages=USER, stream=True, stop=["444"])
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == "Let me think about it: twelve times thirty-seven is "  # nothing past the stop string
    with pytest.raises(openai.BadRequestError) as e:  # refused before generating: an HTTP error, not a stream
        await client.chat.completions.create(model="policy", messages=[{"role": "wizard", "content": "x"}],
                                             stream=True)  # fmt: skip
    assert e.value.body["code"] == "invalid_role" and rec.counts["bad_requests"] == 1
    await client.close()
    await server.stop()


async def test_tiny_model_streams_what_it_records(tok, tiny_model_path):
    """The real engine: `on_token` comes from the continuous batcher's steps; what is streamed is what is recorded."""
    from verl_agent.engine.backends.hf_engine import HFEngine

    engine = HFEngine(str(tiny_model_path), max_num_seqs=4)
    server, rec, client = await _serve(engine, tok)
    seen: list[int] = []
    out = await engine.generate([1, 2, 3], SamplingParams(temperature=0.0, max_new_tokens=12), on_token=lambda t, _: seen.append(t))
    assert seen == out.token_ids and len(seen) >= 2
    stream = await client.chat.completions.create(model="policy", messages=USER, stream=True, max_tokens=16)
    chunks = [c async for c in stream]
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    traj = rec.segments[0].traj
    assert streamed == tok.decode(traj.response_ids, skip_special_tokens=True)
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) >= 2
    await client.close()
    await server.stop()
    await engine.close()
