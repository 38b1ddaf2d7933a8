"""RolloutStream: groups out in finish order, weight updates at turn boundaries (token
boundaries on an engine that can interrupt), versions per turn and per token,
stale groups re-rolled, drained updates, nothing lost. Real agent loop, tools and tokenizer; a scripted
engine with simulated generation time (asyncio sleep) so that turns are in flight when weights change.
"""

from __future__ import annotations

import asyncio

import pytest

from model_helpers import CountingTool, call_text, sample, scripted_engine

from verl_agent.rollout.agent_loop import AgentLoop
from verl_agent.engine.contract import SamplingParams
from verl_agent.rollout.stream import RolloutStream

SP = SamplingParams(max_new_tokens=64, seed=5)


def three_turn_loop(tok, cfg, delay: float = 0.05) -> AgentLoop:
    """Each trajectory: two tool calls then an answer (3 assistant turns), `delay` s per generate call."""
    engine = scripted_engine(tok, [call_text("echo", '{"text": "a"}'), call_text("echo", '{"text": "b"}'), "42"])
    engine.delay = delay
    cfg.multi_turn.max_assistant_turns = 5
    return AgentLoop(engine, tok, cfg, tools={"echo": CountingTool()}, max_prompt_length=400,
                     max_response_length=400)


async def update_weights(stream: RolloutStream, agent: AgentLoop, version: int, drain: bool = False) -> list[int]:
    """What the trainer's sync does; returns the engine's in-flight count seen while paused."""
    await stream.pause(drain=drain)
    seen = [stream.engine._inflight]
    await stream.engine.update_weights([("w", version)])
    agent.policy_version = version
    stream.resume()
    return seen


async def test_partial_rollout_records_the_version_of_every_turn(chat_tokenizer, rollout_cfg):
    agent = three_turn_loop(chat_tokenizer, rollout_cfg)
    stream = RolloutStream(agent)
    stream.feed([sample(uid=f"s{i}") for i in range(4)], 2, SP, batch=1)
    await asyncio.sleep(0.08)  # every trajectory is inside its first or second turn
    assert await update_weights(stream, agent, 1) == [0]  # paused with no forward pass in flight
    groups, dropped = await stream.take(4, min_version=0)
    assert dropped == 0 and [g.position for g in groups] == [0, 1, 2, 3]
    for g in groups:
        for t in g.trajectories:
            versions = [turn.policy_version for turn in t.turns]
            assert len(versions) == 3 and versions == sorted(versions)  # never goes back
            assert versions[0] == 0 and versions[-1] == 1  # cut by the update: old turns 0, later turns 1
            assert t.oldest_version == 0 and t.outcome != "infra_failure"


async def test_drained_update_lets_started_trajectories_finish_on_old_weights(chat_tokenizer, rollout_cfg):
    agent = three_turn_loop(chat_tokenizer, rollout_cfg)
    stream = RolloutStream(agent)
    stream.feed([sample(uid="a"), sample(uid="b")], 2, SP, batch=1)
    await asyncio.sleep(0.02)
    update = asyncio.create_task(update_weights(stream, agent, 1, drain=True))
    await asyncio.sleep(0.01)
    stream.feed([sample(uid="c")], 2, SP, batch=2)  # fed while draining: held back, starts on the new weights
    await update
    groups, _ = await stream.take(3, min_version=0)
    versions = {g.sample.uid: {turn.policy_version for t in g.trajectories for turn in t.turns} for g in groups}
    assert versions == {"a": {0}, "b": {0}, "c": {1}}


async def test_stale_groups_are_rolled_out_again_and_nothing_is_lost(chat_tokenizer, rollout_cfg):
    agent = three_turn_loop(chat_tokenizer, rollout_cfg, delay=0.01)
    stream = RolloutStream(agent)
    stream.feed([sample(uid=f"s{i}") for i in range(3)], 1, SP, batch=1)
    while len(stream.ready) < 3:
        await asyncio.sleep(0.01)
    for v in (1, 2):  # two updates while the groups wait: they are 2 versions old
        await update_weights(stream, agent, v)
    groups, dropped = await stream.take(3, min_version=1)
    assert dropped == 3 and stream.dropped_stale == 3
    assert sorted(g.sample.uid for g in groups) == ["s0", "s1", "s2"]  # re-rolled under version 2
    assert all(turn.policy_version == 2 for g in groups for t in g.trajectories for turn in t.turns)
    assert stream.pending == 0


async def test_groups_come_out_in_finish_order_and_cancel_returns_the_rest(chat_tokenizer, rollout_cfg):
    tok = chat_tokenizer
    engine = scripted_engine(tok, lambda text, k: "slow" if "slow" in text else "fast")

    async def generate(ids, sp, _inner=engine.generate):
        if "slow" in tok.decode(ids):
            await asyncio.sleep(0.3)
        return await _inner(ids, sp)

    engine.generate = generate
    agent = AgentLoop(engine, tok, rollout_cfg, max_prompt_length=400, max_response_length=64)
    stream = RolloutStream(agent)
    stream.feed([sample("slow one", uid="slow"), sample("fast one", uid="fast")], 1, SP, batch=1)
    groups, _ = await stream.take(1, min_version=0)
    assert [g.sample.uid for g in groups] == ["fast"]  # the trainer takes groups as they fill
    assert [s.uid for s in await stream.cancel()] == ["slow"] and stream.pending == 0


async def test_a_loop_that_records_no_versions_is_an_error_not_an_endless_reroll(chat_tokenizer, rollout_cfg):
    agent = three_turn_loop(chat_tokenizer, rollout_cfg, delay=0.0)
    stream = RolloutStream(agent)
    await update_weights(stream, agent, 3)
    inner = agent.run

    async def forgetful_run(samples, n, sampling):  # a user loop that never stamps versions
        batch = await inner(samples, n, sampling)
        for t in batch.trajectories:
            for turn in t.turns:
                turn.policy_version = 0
        return batch

    agent.run = forgetful_run
    stream.feed([sample()], 1, SP, batch=1)
    with pytest.raises(RuntimeError, match="started under version 3"):
        await stream.take(1, min_version=3)


async def test_a_loop_that_raises_gives_infra_failures_of_the_current_version(chat_tokenizer, rollout_cfg):
    """A rollout whose agent loop raises (after the first weight update) comes out as n agent_loop_error
    infra failures stamped with the version it started under: counted, not dropped as stale or an error."""
    agent = three_turn_loop(chat_tokenizer, rollout_cfg, delay=0.0)
    stream = RolloutStream(agent)
    await update_weights(stream, agent, 1)  # step 2 of a sync run: the engine holds version 1

    async def broken_run(samples, n, sampling):
        raise ConnectionError("sandbox went away")

    agent.run = broken_run
    stream.feed([sample()], 2, SP, batch=2)
    groups, dropped = await stream.take(1, min_version=1)
    assert dropped == 0 and stream.dropped_stale == 0 and len(groups) == 1
    assert [(t.outcome, t.cause, t.policy_version, t.oldest_version) for t in groups[0].trajectories] == \
        [("infra_failure", "agent_loop_error", 1, 1)] * 2
    assert "sandbox went away" in groups[0].trajectories[0].error


async def test_partial_rollout_at_a_token_boundary_records_the_version_of_every_token(chat_tokenizer, rollout_cfg):
    """With the real `hf` engine (continuous scheduler) the update interrupts turns mid-generation: each
    turn's tokens carry their own versions, old then new, and the records keep them."""
    from model_helpers import random_qwen2

    from verl_agent.engine.backends.hf_engine import HFEngine
    from verl_agent.rollout.metrics import summarize
    from verl_agent.rollout.records import trajectory_record

    engine = HFEngine(random_qwen2(vocab=len(chat_tokenizer)), stop_on_eos=False, max_model_len=512)
    agent = AgentLoop(engine, chat_tokenizer, rollout_cfg, max_prompt_length=400, max_response_length=96)
    stream = RolloutStream(agent)
    stream.feed([sample(uid=f"s{i}") for i in range(3)], 2, SamplingParams(max_new_tokens=96, seed=5), batch=1)
    inner = stream.engine.engine
    seen, steps = -1, 0.0  # wait until >= 3 turns have decoded side by side for 5 steps (a turn may stop early)
    while True:
        decoding, done = len(inner._batcher.sched.decoding()), inner.metrics()["engine/decode_steps"]
        if decoding != seen:
            seen, steps = decoding, done
        elif decoding >= 3 and done >= steps + 5:
            break
        await asyncio.sleep(0.001)
    await stream.pause()
    await stream.engine.update_weights(random_qwen2(vocab=len(chat_tokenizer), seed=1).state_dict().items())
    agent.policy_version = 1
    stream.resume()
    groups, _ = await stream.take(3, min_version=0)
    cut = 0
    for t in (t for g in groups for t in g.trajectories):
        (turn,) = t.turns
        n = turn.gen_end - turn.gen_start
        versions = turn.token_versions or [turn.policy_version] * n
        k = versions.count(0)
        assert versions == [0] * k + [1] * (n - k) and turn.policy_version == min(versions)
        assert t.token_versions()[turn.gen_start : turn.gen_end] == versions
        assert trajectory_record(t)["turns"][0]["token_versions"] == turn.token_versions
        cut += 0 < k < n
    # every turn in flight at the update was cut mid-way (they were decoding a few steps before)
    assert cut == inner.metrics()["engine/requests_interrupted"] >= 3
    assert summarize([t for g in groups for t in g.trajectories])["rollout/turns_cut_by_update"] == cut
    await engine.close()
