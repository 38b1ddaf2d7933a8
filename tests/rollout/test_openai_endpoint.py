"""The OpenAI-compatible recording endpoint over the scripted engine: wire format, errors, sessions, concurrency."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from model_helpers import assert_mask, call_text, sample, scripted_engine
from transformers import AutoTokenizer

from verl_agent.config import RolloutConfig
from verl_agent.parsers import get_parser
from verl_agent.reward import load_reward_fn
from verl_agent.rollout.openai.agent_function import AgentFunctionLoop
from verl_agent.engine.contract import SamplingParams
from verl_agent.rollout.openai.openai_server import OpenAIServer

openai = pytest.importorskip("openai")

AGENT = "examples/openai_agent/agent.py:run_agent"
REWARD = "verl_agent.models.calculator_task.calculator_reward"
CALL = call_text("calculator", '{"expression": "12*37"}')
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
          "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]  # fmt: skip
USER = [{"role": "user", "content": "What is 12 * 37?"}]


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    return AutoTokenizer.from_pretrained(str(tiny_model_path))


def _loop(engine, tok, entrypoint=AGENT, reward=REWARD, **agent):
    cfg = RolloutConfig()
    for k, v in agent.items():
        setattr(cfg.agent, k, v)
    return AgentFunctionLoop(engine, tok, cfg, entrypoint, reward_fn=load_reward_fn(reward),
                             max_prompt_length=256, max_response_length=96)  # fmt: skip


class _Server:
    """A started endpoint with one session, for wire-level tests."""

    def __init__(self, tok, replies, **kw):
        self.engine = scripted_engine(tok, replies)
        self.server = OpenAIServer(self.engine, tok, get_parser("hermes"), max_request_bytes=4096, **kw)

    async def __aenter__(self):
        await self.server.start()
        self.rec = self.server.open_session(SamplingParams(seed=3), uid="u0")
        self.url = self.server.base_url(self.rec.sid)
        self.http = httpx.AsyncClient(base_url=self.url)
        return self

    async def __aexit__(self, *exc):
        await self.http.aclose()
        await self.server.stop()

    async def post(self, **body):
        return await self.http.post("/chat/completions", json={"model": "policy", "messages": USER, **body})


def _agent_tools():
    import sys

    from verl_agent.rollout.openai.agent_function import load_entrypoint

    return sys.modules[load_entrypoint(AGENT).__module__].TOOLS


def _assert_token_exact(tok, traj, tools):
    from verl_agent.chat import ChatEncoder

    enc = ChatEncoder(tok, tools=tools)
    full = enc.encode_text(enc.render(traj.messages, add_generation_prompt=False))
    ids = traj.prompt_ids + traj.response_ids
    assert full[: len(ids)] == ids and tok.decode(full[len(ids):]) in ("", "\n")


async def test_example_agent_trajectory_is_token_exact(tok):
    loop = _loop(scripted_engine(tok, [CALL, "The answer is 444."]), tok)
    loop.policy_version = 7  # what the trainer sets after a weight swap: every recorded turn carries it
    batch = await loop.run([sample(ground_truth="444")], 2, SamplingParams(seed=1))
    assert {turn.policy_version for t in batch.trajectories for turn in t.turns} == {7}
    assert len(batch) == 2
    for t in batch.trajectories:
        assert (t.outcome, t.reward, t.stop_reason, len(t.turns)) == ("ok", 1.0, "end_of_turn", 2)
        assert t.messages[-2].role == "tool" and t.messages[-2].content == "444"
        assert_mask(t, tok.convert_tokens_to_ids("<|im_end|>"))
        _assert_token_exact(tok, t, _agent_tools())
        assert t.metrics["proxy/calls"] == 2 and t.metrics["num_tool_calls"] == 1


async def test_reward_function_gets_the_turns_and_scores_each_as_in_the_native_loop(tok):
    """An agent that returns None leaves the reward to the reward function, called as AgentLoop calls it:
    extra_info["assistant_turns"] holds each reply's text; a per-turn list sets each turn's score and its sum is
    the reward; a list of the wrong length is the native loop's reward_error."""
    seen = {}

    def per_turn(data_source, solution_str, ground_truth, extra_info=None):
        seen.update(extra_info)
        return [1.0 if "444" in t else 0.25 for t in extra_info["assistant_turns"]]

    loop = _loop(scripted_engine(tok, [CALL, "The answer is 444."]), tok, reward=per_turn)
    [t] = (await loop.run([sample(extra_info={"k": 1})], 1, SamplingParams(seed=1))).trajectories
    assert seen["k"] == 1 and len(seen["assistant_turns"]) == 2
    assert "12*37" in seen["assistant_turns"][0] and seen["assistant_turns"][1] == "The answer is 444."
    assert [turn.score for turn in t.turns] == [0.25, 1.0] and (t.reward, t.outcome) == (1.25, "ok")

    loop = _loop(scripted_engine(tok, [CALL, "The answer is 444."]), tok, reward=lambda text, gt: [1.0])
    [t] = (await loop.run([sample()], 1, SamplingParams(seed=1))).trajectories
    assert (t.outcome, t.cause, t.reward) == ("infra_failure", "reward_error", 0.0)
    assert t.error == "the reward function returned 1 per-turn scores for 2 assistant turns"


async def test_a_reply_after_an_observation_is_capped_by_what_the_observation_left(tok):
    """A call's new-token cap counts its own observation (and forced tool-call ids), as the native loop does: with
    1 token left after them the reply gets 1 token and the trajectory ends exactly at max_response_length (stop
    reason response_budget); with none left the call is refused (400) and ends the run, nothing recorded."""
    long_reply = "The answer is 444. " * 10

    async def two_calls(budget, **body):
        async with _Server(tok, ["The answer is 444.", long_reply], max_prompt_length=256,
                           max_response_length=budget) as s:  # fmt: skip
            r1 = (await s.post(tools=TOOLS)).json()["choices"][0]["message"]
            msgs = [*USER, {"role": "assistant", "content": r1["content"]}, {"role": "user", "content": "Try again."}]
            return s.rec, await s.post(messages=msgs, tools=TOOLS, **body)

    ends = {}  # where the second reply starts: after the observation (and the forced ids)
    for choice in ("auto", "required"):
        rec, r = await two_calls(400, tool_choice=choice)
        assert r.status_code == 200 and rec.stop_reason is None
        first, ends[choice] = rec.segments[0].traj.turns[0].gen_end, rec.segments[0].traj.turns[1].gen_start
    assert ends["required"] > ends["auto"] > first + 1

    rec, r = await two_calls(ends["auto"] + 1)
    t = rec.segments[0].traj
    assert r.json()["choices"][0]["finish_reason"] == "length" and rec.stop_reason == "response_budget"
    assert (t.turns[1].gen_start, t.turns[1].gen_end) == (ends["auto"], ends["auto"] + 1)
    assert len(t.response_ids) == ends["auto"] + 1  # == max_response_length

    rec, r = await two_calls(ends["required"], tool_choice="required")
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert rec.stop_reason == "response_budget" and len(rec.segments[0].traj.response_ids) == first


async def test_a_session_goes_on_after_an_empty_reply(tok):
    """An empty reply renders as "<|im_start|>assistant<|im_end|>", no longer what was generated; as in the native
    loop it stands in as a space, so the next call extends the same trajectory with the native observation ids."""
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    async with _Server(tok, ["", "The answer is 444."]) as s:
        r1 = (await s.post()).json()["choices"][0]["message"]
        msgs = [*USER, {"role": "assistant", "content": r1["content"]}, {"role": "user", "content": "Try again."}]
        r2 = await s.post(messages=msgs)
        assert r2.status_code == 200, r2.text
        assert r2.json()["choices"][0]["message"]["content"] == "The answer is 444."
    [seg] = s.rec.segments
    t, first = seg.traj, seg.traj.turns[0]
    assert t.response_ids[first.gen_start : first.gen_end] == [eos] and len(t.turns) == 2
    obs = tok.decode(t.response_ids[first.gen_end : first.obs_end])
    assert obs == "\n<|im_start|>user\nTry again.<|im_end|>\n<|im_start|>assistant\n"
    assert_mask(t, eos)


async def test_bad_requests_get_openai_errors_and_the_session_stays_usable(tok):
    bad_schema = [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]
    cases = [
        ({"model": "gpt-4o"}, 404, "model_not_found", "model"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "invalid_role", "messages[0].role"),
        ({"tools": bad_schema}, 400, "invalid_tool_schema", "tools[0].function.parameters"),
        ({"tools": [{"type": "function", "function": {}}]}, 400, "invalid_tool", "tools[0]"),
        ({"messages": [{"role": "user", "content": "x" * 5000}]}, 413, "request_too_large", None),
        ({"messages": [{"role": "user", "content": "12 " * 400}]}, 400, "context_length_exceeded", "messages"),
        ({"n": 3}, 400, None, "n"),
        ({"temperature": 7}, 400, None, "temperature"),
        ({"seed": "7"}, 400, None, "seed"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS}, 400, None, "tool_choice"),
        ({"frobnicate": 1}, 400, "unknown_parameter", "frobnicate"),
    ]
    async with _Server(tok, ["The answer is 444."]) as s:
        for body, status, code, param in cases:
            r = await s.post(**body)
            assert r.status_code == status, (body, r.text)
            err = r.json()["error"]
            assert err["code"] == code and err["param"] == param and err["message"], (body, err)
            assert err["type"] in ("invalid_request_error",)
        r = await s.http.post("/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400
        assert s.rec.segments == [] and s.engine.calls == 0  # nothing recorded, nothing generated
        ok = await s.post()
        assert ok.status_code == 200, ok.text
        assert ok.json()["choices"][0]["message"]["content"] == "The answer is 444."
        assert s.rec.counts["bad_requests"] == len(cases) + 1 and s.rec.counts["calls"] == 1
        assert len(s.rec.segments) == 1 and len(s.rec.segments[0].traj.turns) == 1
        # the session key works as an API key on /v1; a wrong key is 401
        plain = httpx.AsyncClient(base_url=f"http://127.0.0.1:{s.server.port}/v1")
        r = await plain.post("/chat/completions", json={"model": "policy", "messages": USER},
                             headers={"Authorization": "Bearer nope"})  # fmt: skip
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = await plain.get("/models")
        assert [m["id"] for m in r.json()["data"]] == ["policy"]
        await plain.aclose()


async def test_openai_sdk_non_streaming_and_streaming_agree(tok):
    async with _Server(tok, [CALL]) as s:
        client = openai.AsyncOpenAI(base_url=s.url, api_key=s.rec.sid, max_retries=0)
        full = await client.chat.completions.create(model="policy", messages=USER, tools=TOOLS, logprobs=True)
        msg = full.choices[0].message
        assert full.choices[0].finish_reason == "tool_calls" and msg.content is None
        assert msg.tool_calls[0].function.name == "calculator"
        assert json.loads(msg.tool_calls[0].function.arguments) == {"expression": "12*37"}
        lps = [c.logprob for c in full.choices[0].logprobs.content]
        assert lps == s.rec.segments[0].traj.rollout_logprobs and full.usage.completion_tokens == len(lps)

        # a different conversation (no history shared): a new segment; streamed through the SDK
        stream = await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "Again: 12 * 37?"}], tools=TOOLS, stream=True,
            stream_options={"include_usage": True})  # fmt: skip
        chunks = [c async for c in stream]
        calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        assert (calls[0].index, calls[0].function.name, calls[0].type) == (0, "calculator", "function") and calls[0].id
        assert "".join(c.function.arguments for c in calls) == msg.tool_calls[0].function.arguments
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
        assert chunks[-1].usage.completion_tokens == len(lps)
        assert len(s.rec.segments) == 2 and s.rec.counts["history_rewrites"] == 1
        # raw SSE framing
        r = await s.http.post("/chat/completions", json={"model": "policy", "messages": USER, "stream": True})
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [e for e in r.text.split("\n\n") if e]
        assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
        first = json.loads(events[0][6:])
        assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"]["role"] == "assistant"
        await client.close()


def _forced_aware(text, k):
    """A model that answers in prose unless its reply was started for it, then completes the call it was given."""
    if text.endswith('"name": "calculator", "arguments": '):
        return '{"expression": "12*37"}}\n</tool_call>'
    if text.endswith('"name": "search", "arguments": '):
        return '{"q": "12*37"}}\n</tool_call>'
    if text.endswith("<tool_call>\n"):
        return '{"name": "calculator", "arguments": {"expression": "12*37"}}\n</tool_call>'
    return "I think it is 444."


async def test_tool_choice_none_and_auto(tok):
    async with _Server(tok, [CALL]) as s:
        r = await s.post(tools=TOOLS, tool_choice="none")  # tools are shown but calls are not parsed
        none = r.json()["choices"][0]
        assert none["finish_reason"] == "stop" and "<tool_call>" in none["message"]["content"]
        assert "tool_calls" not in none["message"]
        r = await s.post(tools=TOOLS, tool_choice="auto")
        assert r.json()["choices"][0]["finish_reason"] == "tool_calls"


async def test_tool_choice_required_and_named_are_enforced(tok):
    """`required` / a named function: the reply is started with the call's opening text (recorded with mask 0,
    as context), so a model that would answer in prose calls a tool; the generated rest is trained on."""
    other = TOOLS + [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
    named = {"type": "function", "function": {"name": "search"}}
    async with _Server(tok, _forced_aware) as s:
        free = (await s.post(tools=TOOLS)).json()["choices"][0]
        assert free["finish_reason"] == "stop" and free["message"]["content"] == "I think it is 444."
        for choice, name in (("required", "calculator"), (named, "search")):
            r = await s.post(messages=[{"role": "user", "content": f"use {name}"}], tools=other, tool_choice=choice)
            body = r.json()["choices"][0]
            assert body["finish_reason"] == "tool_calls", body
            assert [c["function"]["name"] for c in body["message"]["tool_calls"]] == [name]
            traj = s.rec.segments[-1].traj
            forced = s.server._forced_ids(choice if choice == "required" else name)
            assert traj.prompt_ids[-len(forced):] == forced and traj.loss_mask == [1] * len(traj.response_ids)
            assert tok.decode(forced + traj.response_ids).startswith("<tool_call>\n{")
        # a later turn: the forced ids are context after the tool result (mask 0), the call is generated (mask 1)
        call = body["message"]
        msgs = [{"role": "user", "content": "use search"}, call,
                {"role": "tool", "tool_call_id": call["tool_calls"][0]["id"], "content": "444"}]
        r = await s.post(messages=msgs, tools=other, tool_choice="required")
        assert r.json()["choices"][0]["finish_reason"] == "tool_calls" and len(s.rec.segments) == 3
        traj = s.rec.segments[-1].traj
        first, second = traj.turns
        forced = s.server._forced_ids("required")
        assert traj.response_ids[second.gen_start - len(forced):second.gen_start] == forced
        assert traj.loss_mask[first.gen_end:second.gen_start] == [0] * (second.gen_start - first.gen_end)
        assert set(traj.loss_mask[second.gen_start:]) == {1} and s.rec.counts["tool_choice_violations"] == 0


async def test_tool_choice_violations_come_back_as_text(tok):
    other = TOOLS + [{"type": "function", "function": {"name": "search", "parameters": {"type": "object"}}}]
    async with _Server(tok, ['{"name": "calculator", "arguments": {}}\n</tool_call>']) as s:
        r = await s.post(tools=other, tool_choice={"type": "function", "function": {"name": "search"}})
        body = r.json()["choices"][0]  # forced into search, the model wrote calculator's body: broken JSON, as text
        assert body["finish_reason"] == "stop" and "tool_calls" not in body["message"]
        assert body["message"]["content"].startswith('<tool_call>\n{"name": "search"')
        assert s.rec.counts["malformed_calls"] == 1
    async with _Server(tok, ["no call"]) as s:  # a format without a forced prefix: checked after the fact
        s.server.parser = type("P", (), {"name": "other", "parse": s.server.parser.parse})()
        r = await s.post(tools=other, tool_choice="required")
        body = r.json()["choices"][0]
        assert (body["finish_reason"], body["message"]["content"]) == ("stop", "no call")
        assert s.rec.counts["tool_choice_violations"] == 1


async def test_malformed_call_comes_back_as_content(tok):
    async with _Server(tok, ['<tool_call>\n{"name": "calculator", "arguments": {"expression": </tool_call>']) as s:
        r = await s.post(tools=TOOLS)
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop" and "<tool_call>" in choice["message"]["content"]
        assert s.rec.counts["malformed_calls"] == 1


async def test_history_rewrite_starts_a_new_segment(tok):
    async def rewriting_agent(sample, base_url, api_key):
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        msgs = list(sample["messages"])
        r = await client.chat.completions.create(model="policy", messages=msgs, tools=TOOLS)
        call = r.choices[0].message.tool_calls[0]
        edited = {"role": "assistant", "content": "let me think", "tool_calls": [call.model_dump()]}  # edited turn
        msgs += [edited, {"role": "tool", "tool_call_id": call.id, "content": "444"}]
        await client.chat.completions.create(model="policy", messages=msgs, tools=TOOLS)
        await client.close()
        return 1.0

    loop = _loop(scripted_engine(tok, [CALL, "The answer is 444."]), tok, entrypoint=rewriting_agent)
    batch = await loop.run([sample(uid="q7")], 1, SamplingParams(seed=0))
    assert [t.uid for t in batch.trajectories] == ["q7", "q7"]
    first, second = batch.trajectories
    assert [t.metrics["segment"] for t in batch.trajectories] == [0.0, 1.0]
    assert (first.reward, second.reward) == (1.0, 1.0) and loop.counts["history_rewrites"] == 1
    assert len(first.turns) == 1 and len(second.turns) == 1 and sum(second.loss_mask) == len(second.response_ids)
    assert "let me think" in tok.decode(second.prompt_ids)  # the new segment's prompt is the edited history
    for t in batch.trajectories:
        _assert_token_exact(tok, t, TOOLS)


async def test_failures_are_classified(tok):
    class Broken:
        async def generate(self, prompt_ids, sampling):
            raise RuntimeError("GPU on fire")

        async def close(self):
            pass

    loop = _loop(Broken(), tok)  # the agent raises openai.InternalServerError: our endpoint's fault
    [t] = (await loop.run([sample()], 1, SamplingParams())).trajectories
    assert (t.outcome, t.cause, t.trainable) == ("infra_failure", "engine_error", False) and "GPU on fire" in t.error

    async def buggy_agent(sample, base_url, api_key):
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        await client.chat.completions.create(model="policy", messages=sample["messages"])
        raise KeyError("the agent's own bug")

    loop = _loop(scripted_engine(tok, ["The answer is 444."]), tok, entrypoint=buggy_agent)
    [t] = (await loop.run([sample(ground_truth="444")], 1, SamplingParams())).trajectories
    assert (t.outcome, t.cause, t.reward, t.trainable) == ("policy_failure", "agent_error", 0.0, True)

    async def slow_agent(sample, base_url, api_key):
        await asyncio.sleep(10)

    loop = _loop(scripted_engine(tok, ["x"]), tok, entrypoint=slow_agent, timeout=0.2)
    [t] = (await loop.run([sample()], 1, SamplingParams())).trajectories
    assert (t.outcome, t.cause) == ("infra_failure", "agent_timeout")


@pytest.mark.timeout(300)
async def test_256_concurrent_agents_none_lost(tok):
    engine = scripted_engine(tok, [CALL, "The answer is 444."], delay=0.01)
    loop = _loop(engine, tok)
    samples = [sample(uid=f"u{i}", ground_truth="444") for i in range(64)]
    batch = await loop.run(samples, 4, SamplingParams(seed=5))
    assert len(batch) == 256 and engine.calls == 512
    assert [t.uid for t in batch.trajectories] == [f"u{i}" for i in range(64) for _ in range(4)]
    for t in batch.trajectories:
        assert (t.outcome, len(t.turns), t.metrics["proxy/calls"]) == ("ok", 2, 2.0), (t.outcome, t.error)
    assert loop.counts["calls"] == 512 and loop.counts["history_rewrites"] == 0 and not loop.server.sessions


async def test_unreachable_endpoint_is_an_infra_failure(tok):
    async def lost_agent(sample, base_url, api_key):
        client = openai.AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key=api_key, max_retries=0)
        await client.chat.completions.create(model="policy", messages=sample["messages"])

    loop = _loop(scripted_engine(tok, ["x"]), tok, entrypoint=lost_agent)
    [t] = (await loop.run([sample()], 1, SamplingParams())).trajectories
    assert (t.outcome, t.cause, t.trainable) == ("infra_failure", "endpoint_unreachable", False)


async def test_overlapping_runs_share_one_endpoint(tok):
    """The trainer's rollout stream calls run() for several groups at once; none may stop the others' server."""
    engine = scripted_engine(tok, [CALL, "The answer is 444."], delay=0.02)
    loop = _loop(engine, tok)
    batches = await asyncio.gather(*(loop.run([sample(uid=f"g{i}", ground_truth="444")], 4, SamplingParams(seed=i))
                                     for i in range(6)))  # fmt: skip
    for b in batches:
        assert [t.outcome for t in b.trajectories] == ["ok"] * 4, [t.error for t in b.trajectories]
    assert loop._users == 0 and loop.server._server is None


def test_logprob_tokens_are_text_and_bytes_not_vocabulary_symbols(tok):
    """logprobs.content[i].bytes are the token's own bytes ('Ġcaf' is b' caf'; 'Ã' '©' are the two bytes of
    'é'), so joining them gives the reply's text back, as OpenAI's do."""
    from verl_agent.rollout.openai.openai_wire import token_bytes

    text = " hello café ✓ <tool_call>"
    raw = token_bytes(tok, tok.encode(text, add_special_tokens=False))
    assert b"".join(raw).decode() == text and raw[0] == b" he"
