"""Context strategies and budgets of the native agent loop: segments, exact token accounting, stop reasons.

The engine is scripted (verl_agent.engine.scripted) and wrapped to record every call, so that each trained
token can be traced to the call that generated it and the context it saw; the tokenizer, chat template,
interaction and tools are the real ones.
"""

from __future__ import annotations

import pytest
from model_helpers import assert_mask, assert_token_exact, sample, scripted_engine

from verl_agent.chat import ChatEncoder
from verl_agent.config import ConfigError, RolloutConfig, load_config
from verl_agent.engine.contract import SamplingParams
from verl_agent.interactions.base import BaseInteraction
from verl_agent.protocol import Message
from verl_agent.rollout.agent_loop import AgentLoop
from verl_agent.rollout.context import DROPPED_PREFIX, SUMMARY_PREFIX
from verl_agent.rollout.metrics import summarize

SP = SamplingParams(max_new_tokens=400)
ROOM = "Room {k}: " + "Hello world. " * 20


class Rooms(BaseInteraction):
    """Answers every reply with a long room description; after `rooms` rooms, asks for the answer (reward 1 if 444)."""

    async def generate_response(self, instance_id, messages, **kwargs):
        st = self.instances[instance_id]
        self.__dict__.setdefault("seen", []).append([m["content"] for m in messages])
        st["turns"] += 1
        if st["turns"] > self.config.get("rooms", 5) + 1:
            st["score"] = float("444" in messages[-1]["content"])
            return True, "Goodbye.", st["score"], {}
        if st["turns"] > self.config.get("rooms", 5):
            return False, "Exit: the answer?", 0.0, {}
        return False, ROOM.format(k=st["turns"]), 0.0, {}


class Recording:
    """Wraps an engine; keeps (prompt ids, output) of every call."""

    def __init__(self, engine):
        self.engine, self.calls, self.sessions = engine, [], []

    async def generate(self, prompt_ids, sampling, *, session=None):
        out = await self.engine.generate(prompt_ids, sampling, session=session)
        self.calls.append((list(prompt_ids), out))
        self.sessions.append(session)
        return out

    async def release_session(self, session):
        pass


def reply(text, k):
    if "Summarize" in text.rsplit("<|im_start|>user", 1)[-1]:
        return "I walked through rooms; say 444 at the end."
    return "The answer is 444." if "Room" not in text.rsplit("<|im_start|>user", 1)[-1] else f"step {k}"


def run(tok, cfg, rooms=5, engine=None, max_response_length=1200, tools=None, s=None):
    engine = engine or Recording(scripted_engine(tok, reply))
    inter = {"rooms": Rooms({"name": "rooms", "rooms": rooms})}
    cfg.multi_turn.max_user_turns = cfg.multi_turn.max_assistant_turns = 40
    loop = AgentLoop(engine, tok, cfg, tools=tools, interactions=inter, max_prompt_length=200,
                     max_response_length=max_response_length)
    s = s or sample("Say 444 at the end.", interaction_kwargs={"name": "rooms"})
    return loop, engine, loop.run([s], 1, SP)


def context_cfg(strategy, max_context_length=300, **context):
    cfg = RolloutConfig()
    cfg.multi_turn.max_context_length = max_context_length
    for k, v in {"strategy": strategy, **context}.items():
        setattr(cfg.multi_turn.context, k, v)
    return cfg


def assert_segments_exact(tok, segs, engine, tools=None):
    """Every generated span is an engine output verbatim, made from exactly the segment's ids before it; each
    segment's ids are the template's encoding of its messages; the model's tokens over all segments are all
    the engine's outputs, in order (nothing generated is lost, re-tokenized or trained twice)."""
    calls = iter(engine.calls)
    for t in segs:
        assert t.uid == segs[0].uid and t.reward == segs[-1].reward and t.outcome == segs[-1].outcome
        assert_token_exact(tok, t, tools)
        for turn in t.turns:
            prompt, out = next(calls)
            assert prompt == t.prompt_ids + t.response_ids[: turn.gen_start]
            assert t.response_ids[turn.gen_start : turn.gen_end] == list(out.token_ids)
            assert t.rollout_logprobs[turn.gen_start : turn.gen_end] == list(out.logprobs)
        assert_mask(t, tok.convert_tokens_to_ids("<|im_end|>"))
    assert next(calls, None) is None
    assert sum(t.num_model_tokens for t in segs) == sum(len(o.token_ids) for _, o in engine.calls)


async def test_drop_observations_segments_are_token_exact(chat_tokenizer):
    tok = chat_tokenizer
    loop, engine, job = run(tok, context_cfg("drop_observations", keep_last_turns=1), rooms=4)
    segs = (await job).trajectories
    assert len(segs) >= 3 and [t.stop_reason for t in segs] == ["context_rewrite"] * (len(segs) - 1) + ["interaction_done"]
    assert segs[-1].reward == 1.0 and all(t.outcome == "ok" for t in segs)
    assert [t.metrics["segment"] for t in segs] == list(range(len(segs)))
    assert segs[-1].metrics["context/rewrites"] == len(segs) - 1
    # generated + observation tokens over all segments; an observation a rewrite moved into the next
    # segment's prompt counts once, as the tokens it would have taken in the old one
    moved = sum(len(ChatEncoder(tok).encode_observation(old.messages, new.messages[first_len(tok, new) - 1 :
                                                                                     first_len(tok, new)]))
                for old, new in zip(segs, segs[1:]))  # fmt: skip
    assert segs[-1].metrics["context/total_tokens"] == sum(len(t.response_ids) for t in segs) + moved
    assert_segments_exact(tok, segs, engine)
    for t in segs:
        assert len(t.prompt_ids) + len(t.response_ids) <= 300
    m = summarize(segs)  # success and stops per episode, lengths per trained sequence
    assert (m["rollout/num_episodes"], m["rollout/num_trajectories"], m["rollout/success_rate"]) == (1, len(segs), 1)
    assert m["rollout/stop/interaction_done"] == 1 and m["rollout/context/rewrites"] == len(segs) - 1
    later = segs[-1].messages
    assert later[0].content == "Say 444 at the end."  # the task stays
    dropped = [m for m in later if m.content.startswith(DROPPED_PREFIX)]
    assert dropped and all(m.role == "user" and "user message" in m.content for m in dropped)
    assert later[-2].content.startswith("Room") or later[-1].role == "assistant"


def first_len(tok, t):
    """How many messages a segment started with: those its prompt ids encode."""
    enc = ChatEncoder(tok)
    return next(n for n in range(1, len(t.messages) + 1) if enc.encode_prompt(t.messages[:n]) == t.prompt_ids)


async def test_truncate_middle_keeps_the_task_and_the_last_tokens(chat_tokenizer):
    tok = chat_tokenizer
    loop, engine, job = run(tok, context_cfg("truncate_middle", keep_last_tokens=90))
    segs = (await job).trajectories
    assert len(segs) >= 2 and segs[-1].reward == 1.0
    assert_segments_exact(tok, segs, engine)
    # KV reuse: one engine session for the whole episode, and each new segment's first call shares the task's
    # prompt with the call before it (the hf engine keeps that prefix's K/V: test_hf_engine_continuous.py)
    assert len(set(engine.sessions)) == 1 and engine.sessions[0] is not None
    enc = ChatEncoder(tok)
    head = enc.encode_text(enc.render(segs[0].messages[:1], add_generation_prompt=False))  # the task's ids
    firsts = [next(i for i, (p, _) in enumerate(engine.calls) if p == t.prompt_ids) for t in segs[1:]]
    for i in firsts:
        before, now = engine.calls[i - 1][0] + list(engine.calls[i - 1][1].token_ids), engine.calls[i][0]
        assert now[: len(head)] == before[: len(head)] == head and now[: len(before)] != before
    for t in segs[1:]:
        n = first_len(tok, t)
        assert t.messages[0].content == "Say 444 at the end."
        assert t.messages[1].role == "assistant"  # the kept tail starts at a reply
        assert sum(len(tok.encode(m.content, add_special_tokens=False)) for m in t.messages[1:n]) <= 90


async def test_summarize_trains_the_summary_turn_and_restarts_from_task_and_summary(chat_tokenizer):
    tok = chat_tokenizer
    loop, engine, job = run(tok, context_cfg("summarize", max_context_length=300, summary_prompt="Summarize now.",
                                             summary_max_tokens=60))
    segs = (await job).trajectories
    assert len(segs) >= 2 and segs[-1].reward == 1.0
    assert_segments_exact(tok, segs, engine)
    for old, new in zip(segs, segs[1:]):
        assert [m.role for m in old.messages[-2:]] == ["user", "assistant"]
        assert old.messages[-2].content == "Summarize now."
        summary = old.messages[-1].content
        assert summary == "I walked through rooms; say 444 at the end."
        last = old.turns[-1]  # the summary turn: trained (mask 1), the last of its segment
        assert tok.decode(old.response_ids[last.gen_start : last.gen_end], skip_special_tokens=True) == summary
        # the history restarts from the task and the summary, then the observation that did not fit
        assert [m.content for m in new.messages[:2]] == ["Say 444 at the end.", SUMMARY_PREFIX + summary]
        assert new.messages[2].content.startswith(("Room", "Exit"))
        assert new.prompt_ids == ChatEncoder(tok).encode_prompt(new.messages[:3])
    assert segs[-1].metrics["context/summary_turns"] == len(segs) - 1
    assert segs[-1].metrics["num_turns"] == len(segs[-1].turns)


async def test_user_strategy_is_called_with_the_context_and_its_result_is_the_next_segment(chat_tokenizer, tmp_path):
    tok = chat_tokenizer
    (tmp_path / "keep.py").write_text(
        "CALLS = []\n"
        "def keep_task_and_last(messages):\n"
        "    CALLS.append(messages)\n"
        "    return [messages[0], {'role': 'user', 'content': 'earlier rooms skipped'}, *messages[-1:]]\n")
    cfg = context_cfg(f"{tmp_path}/keep.py:keep_task_and_last")
    loop, engine, job = run(tok, cfg)
    segs = (await job).trajectories
    from verl_agent.imports import import_object

    calls = import_object(f"{tmp_path}/keep.py:CALLS")
    assert len(calls) == len(segs) - 1 >= 1
    for call, old, new in zip(calls, segs, segs[1:]):
        # the context the model saw (the old segment's messages) plus the observation that did not fit
        assert call[:-1] == [m.to_chat() for m in old.messages]
        assert call[-1]["role"] == "user" and call[-1]["content"].startswith("Room")
        assert [m.to_chat() for m in new.messages[:3]] == [call[0], {"role": "user", "content": "earlier rooms skipped"},
                                                           call[-1]]  # fmt: skip
    assert_segments_exact(tok, segs, engine)
    # the interaction is shown the whole episode, not the model's rewritten context
    last_seen = loop.interactions["rooms"].seen[-1]
    assert [c for c in last_seen if c.startswith("Room")] == [ROOM.format(k=k) for k in range(1, 6)]
    assert "earlier rooms skipped" not in last_seen and len(last_seen) == 1 + 7 + 6  # task, replies, rooms + exit


@pytest.mark.parametrize("body, match", [("raise RuntimeError('boom')", "raised RuntimeError: boom"),
                                         ("return 'text'", "returned str"),
                                         ("return [{'role': 'robot'}]", "result\\[0\\]")])
async def test_a_failing_user_strategy_is_an_infra_failure_of_that_trajectory_only(chat_tokenizer, tmp_path, body,
                                                                                   match):  # fmt: skip
    import re

    tok = chat_tokenizer
    (tmp_path / "bad.py").write_text(f"def bad(messages):\n    if len(messages) > 5:\n        {body}\n    return messages\n")
    cfg = context_cfg(f"{tmp_path}/bad.py:bad")
    engine = Recording(scripted_engine(tok, reply))
    inter = {"rooms": Rooms({"name": "rooms", "rooms": 5})}
    cfg.multi_turn.max_user_turns = cfg.multi_turn.max_assistant_turns = 40
    loop = AgentLoop(engine, tok, cfg, interactions=inter, max_prompt_length=200, max_response_length=1200)
    short = sample("Say 444 at the end.", uid="short", interaction_kwargs={"name": "rooms"})
    batch = await loop.run([sample("Say 444 at the end.", interaction_kwargs={"name": "rooms"})], 1, SP)
    (t,) = batch.trajectories
    assert (t.outcome, t.cause, t.stop_reason, t.reward) == ("infra_failure", "context_error", "error", 0.0)
    assert re.search(match, t.error)
    # a trajectory that never needs a rewrite is untouched
    inter["rooms"].config["rooms"] = 1
    (ok,) = (await loop.run([short], 1, SP)).trajectories
    assert ok.outcome == "ok" and ok.reward == 1.0


async def test_a_strategy_failing_after_a_rewrite_fails_every_segment_of_its_episode_once(chat_tokenizer, tmp_path):
    tok = chat_tokenizer
    (tmp_path / "late.py").write_text("N = []\ndef late(messages):\n    N.append(1)\n"
                                      "    if len(N) > 1:\n        raise RuntimeError('late')\n"
                                      "    return [messages[0], messages[-1]]\n")
    loop, engine, job = run(tok, context_cfg(f"{tmp_path}/late.py:late"))
    segs = (await job).trajectories
    assert len(segs) == 2 and all((t.outcome, t.cause, t.reward) == ("infra_failure", "context_error", 0.0) for t in segs)
    m = summarize(segs)
    assert (m["rollout/num_episodes"], m["rollout/infra_failed"], m["rollout/infra_failed/context_error"]) == (1, 1, 1)


async def test_each_budget_stops_with_its_own_reason(chat_tokenizer):
    tok = chat_tokenizer
    cases = [("max_tokens_per_turn", {"max_tokens_per_turn": 3}, 1200),
             ("max_context_length", {"max_context_length": 150}, 1200),
             ("max_total_tokens", {"max_total_tokens": 120}, 1200),
             ("response_budget", {}, 100)]
    for reason, keys, budget in cases:
        cfg = RolloutConfig()
        for k, v in keys.items():
            setattr(cfg.multi_turn, k, v)
        loop, engine, job = run(tok, cfg, max_response_length=budget)
        (t,) = (await job).trajectories
        assert (t.stop_reason, t.outcome, t.cause) == (reason, "policy_failure", "budget_exhausted"), reason
        used = len(t.prompt_ids) + len(t.response_ids)
        if reason == "max_context_length":
            assert used <= 150 < used + len(ChatEncoder(tok).encode_observation(
                t.messages, [Message(role="user", content=ROOM.format(k=len(t.turns)))]))
        if reason == "max_total_tokens":
            assert len(t.response_ids) <= 120
        if reason == "max_tokens_per_turn":
            assert t.turns[-1].gen_end - t.turns[-1].gen_start == 3
    # max_total_tokens spans segments: a rewrite does not reset it
    cfg = context_cfg("drop_observations", keep_last_turns=1)
    cfg.multi_turn.max_total_tokens = 400
    loop, engine, job = run(tok, cfg, rooms=30)
    segs = (await job).trajectories
    assert len(segs) >= 2 and segs[-1].stop_reason == "max_total_tokens"
    assert segs[-1].metrics["context/total_tokens"] <= 400


def test_context_config_is_checked():
    with pytest.raises(ConfigError, match="needs multi_turn.max_context_length"):
        load_config(None, ["actor_rollout_ref.rollout.multi_turn.context.strategy=summarize"])
    with pytest.raises(ConfigError, match="unknown context strategy 'shorten'"):
        load_config(None, ["actor_rollout_ref.rollout.multi_turn.context.strategy=shorten"])
    with pytest.raises(ConfigError, match="trigger_length=300 must be below"):
        load_config(None, ["actor_rollout_ref.rollout.multi_turn.max_context_length=200",
                           "actor_rollout_ref.rollout.multi_turn.context.strategy=truncate_middle",
                           "actor_rollout_ref.rollout.multi_turn.context.trigger_length=300"])
    with pytest.raises(ConfigError, match="max_context_length=100: the native agent loop reads it"):
        load_config(None, ["actor_rollout_ref.rollout.agent.entrypoint=pkg.mod:run_agent",
                           "actor_rollout_ref.rollout.multi_turn.max_context_length=100"])
    cfg = load_config(None, ["actor_rollout_ref.rollout.multi_turn.context.strategy=none"])
    assert cfg.actor_rollout_ref.rollout.multi_turn.context.strategy == "none"
    from verl_agent.rollout.context import ContextStrategy

    with pytest.raises(ValueError, match="context.strategy='no_such_module:fn'.*no_such_module"):
        ContextStrategy(context_cfg("no_such_module:fn").multi_turn.context, None)


def test_summarize_without_room_for_its_turn_fails_at_load_naming_what_to_change(chat_tokenizer):
    mt = "actor_rollout_ref.rollout.multi_turn"
    keys = [f"{mt}.max_context_length=448", f"{mt}.max_tokens_per_turn=16", f"{mt}.context.strategy=summarize"]
    load_config(None, [*keys, f"{mt}.context.trigger_length=200"])  # 448 - 200 - 16 = 232 >= 128
    # 448 - 380 - 16 = 52 tokens for a 128-token summary: 76 short
    with pytest.raises(ConfigError, match=r"room for 52 summary tokens.*raise multi_turn.max_context_length to 524 "
                                          r"or lower multi_turn.context.trigger_length to 304 or lower "
                                          r"multi_turn.context.summary_max_tokens to 52"):
        load_config(None, [*keys, f"{mt}.context.trigger_length=380"])
    # room enough without the summary prompt, not with it: the agent loop counts its tokens with the tokenizer
    cfg = context_cfg("summarize", max_context_length=448, trigger_length=200, summary_max_tokens=200)
    cfg.multi_turn.max_tokens_per_turn = 16
    request = len(chat_tokenizer.encode(cfg.multi_turn.context.summary_prompt)) + 16
    with pytest.raises(ValueError, match=rf"room for {232 - request} summary tokens.*summary prompt \({request} "):
        AgentLoop(Recording(scripted_engine(chat_tokenizer, reply)), chat_tokenizer, cfg)


async def test_a_rewrite_the_strategy_cannot_make_is_counted(chat_tokenizer, caplog):
    # the whole history is shorter than keep_last_tokens: truncate_middle has nothing to cut
    loop, _, job = run(chat_tokenizer, context_cfg("truncate_middle", max_context_length=300, keep_last_tokens=1000))
    (t,) = (await job).trajectories
    assert t.stop_reason == "max_context_length" and t.metrics["context/rewrites_skipped"] >= 1
    assert summarize([t])["rollout/context/rewrites_skipped"] == t.metrics["context/rewrites_skipped"]
    assert "could not rewrite the history" in caplog.text and "left the context as it was" in caplog.text
