"""AgentLoop with a scripted engine: exact token ids, masks and stop reasons over multi-turn conversations.

The engine is scripted (verl_agent.engine.backends.scripted) so that every generated
token is known in advance; tools, interactions, chat templates and the
tokenizer are the real ones.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from model_helpers import CountingTool, assert_mask, assert_token_exact, call_text, sample, scripted_engine

from verl_agent.interactions.base import BaseInteraction
from verl_agent.reward import load_reward_fn
from verl_agent.rollout.agent_loop import AgentLoop
from verl_agent.engine.contract import SamplingParams, turn_seed
from verl_agent.engine.backends.scripted import ScriptedEngine
from verl_agent.tools import CalculatorTool

SP = SamplingParams(max_new_tokens=200)


def answer_reward(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0 if str(ground_truth) in solution_str else 0.0


def loop(tok, engine, cfg, tools=None, interactions=None, reward=None, max_response_length=400):
    return AgentLoop(engine, tok, cfg, tools=tools, interactions=interactions, reward_fn=reward,
                     max_prompt_length=400, max_response_length=max_response_length)  # fmt: skip


async def one(agent_loop, s=None):
    return (await agent_loop.run([s or sample()], 1, SP)).trajectories[0]


async def test_tool_call_then_answer_is_token_exact(chat_tokenizer, rollout_cfg):
    tok = chat_tokenizer
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    engine = scripted_engine(tok, [call_text("calculator", '{"expression": "12*37"}'), "The answer is 444."])
    tools = {"calculator": CalculatorTool()}
    batch = await loop(tok, engine, rollout_cfg, tools, reward=load_reward_fn(answer_reward)).run(
        [sample(ground_truth="444")], n=2, sampling=SP
    )
    assert len(batch) == 2 and batch.groups() == {"s0": [0, 1]}
    for traj in batch.trajectories:
        assert traj.stop_reason == "end_of_turn" and traj.error is None
        assert [m.role for m in traj.messages] == ["user", "assistant", "tool", "assistant"]
        assert traj.messages[1].tool_calls[0].arguments == {"expression": "12*37"}
        assert traj.messages[2].content == "444"
        assert traj.reward == 1.0
        assert len(traj.turns) == 2 and traj.turns[0].num_tool_calls == 1
        assert traj.turns[0].obs_end == traj.turns[1].gen_start
        assert traj.turns[1].obs_end == traj.turns[1].gen_end == len(traj.response_ids)
        assert traj.metrics["num_tool_calls"] == 1 and traj.metrics["num_turns"] == 2
        assert_token_exact(tok, traj, tools)
        assert_mask(traj, eos)


async def test_parallel_calls_limit_and_concurrency(chat_tokenizer, rollout_cfg):
    tok = chat_tokenizer
    calls = "\n".join(call_text("echo", f'{{"text": "t{i}"}}') for i in range(3))
    engine = scripted_engine(tok, [calls, "done"])
    echo = CountingTool(delay=0.2)
    rollout_cfg.multi_turn.max_parallel_calls = 2
    traj = (await loop(tok, engine, rollout_cfg, {"echo": echo}).run([sample()], 1, SP)).trajectories[0]
    tool_msgs = [m for m in traj.messages if m.role == "tool"]
    assert [m.content for m in tool_msgs[:2]] == ["t0", "t1"]
    assert "was not run" in tool_msgs[2].content and "max_parallel_calls" in tool_msgs[2].content
    assert echo.peak == 2  # the two allowed calls ran at the same time
    assert traj.turns[0].num_tool_calls == 3 and traj.metrics["num_tool_errors"] == 1
    assert traj.turns[0].score == pytest.approx(0.5)  # two step rewards of 0.25
    assert traj.reward == pytest.approx(0.5)  # no reward fn, no interaction: the tools' calc_reward
    assert echo.created == echo.released == 1
    assert_token_exact(tok, traj, {"echo": echo})


@pytest.mark.parametrize("side", ["left", "middle", "right"])
async def test_tool_response_truncated(chat_tokenizer, rollout_cfg, side):
    tok = chat_tokenizer
    engine = scripted_engine(tok, [call_text("echo", '{"text": "abcdefghij"}'), "ok"])
    rollout_cfg.multi_turn.max_tool_response_length = 40
    rollout_cfg.multi_turn.tool_response_truncate_side = side
    tools = {"echo": CountingTool(text_len=1000)}
    traj = await one(loop(tok, engine, rollout_cfg, tools, max_response_length=2000))
    content = traj.messages[2].content
    assert len(content) == 40 and "(truncated)" in content
    assert content.startswith("abc") == (side != "left") and content.endswith("hij") == (side != "right")
    assert_token_exact(tok, traj, tools)


async def test_parse_error_is_a_message_and_a_policy_failure(chat_tokenizer, rollout_cfg):
    tok = chat_tokenizer
    bad = '<tool_call>\n{"name": "echo", "arguments": {broken\n</tool_call>'
    engine = scripted_engine(tok, [bad, "gave up"])
    echo = CountingTool()
    traj = (await loop(tok, engine, rollout_cfg, {"echo": echo}).run([sample()], 1, SP)).trajectories[0]
    tools = [m.content for m in traj.messages if m.role == "tool"]
    assert len(tools) == 1 and tools[0].startswith("Error: could not parse") and "broken" in tools[0]
    assert traj.stop_reason == "end_of_turn" and traj.metrics["num_tool_errors"] == 1
    assert (traj.outcome, traj.cause) == ("policy_failure", "malformed_tool_call") and traj.trainable
    assert echo.released == 1


async def test_tool_crash_inside_our_code_is_an_infra_failure(chat_tokenizer, rollout_cfg):
    """A tool whose own code raises ends that trajectory as an infrastructure failure (never reward)."""
    tok = chat_tokenizer
    engine = scripted_engine(tok, [call_text("echo", '{"text": "x"}'), "gave up"])
    echo = CountingTool(fail=True)
    traj = await one(loop(tok, engine, rollout_cfg, {"echo": echo}))
    assert (traj.outcome, traj.cause, traj.stop_reason) == ("infra_failure", "tool_crash", "error")
    assert "echo broke" in traj.error and traj.reward == 0.0 and not traj.trainable
    assert echo.released == 1  # release still runs


async def test_wrong_arguments_are_the_models_fault(chat_tokenizer, rollout_cfg):
    tok = chat_tokenizer
    engine = scripted_engine(tok, [call_text("echo", '{"txt": "x"}'), "gave up"])
    traj = await one(loop(tok, engine, rollout_cfg, {"echo": CountingTool()}))
    assert (traj.outcome, traj.cause) == ("policy_failure", "tool_error")


async def test_max_assistant_turns(chat_tokenizer, rollout_cfg):
    tok = chat_tokenizer
    engine = scripted_engine(tok, [call_text("calculator", '{"expression": "1+1"}')])
    rollout_cfg.multi_turn.max_assistant_turns = 3
    traj = await one(loop(tok, engine, rollout_cfg, {"calculator": CalculatorTool()}))
    assert traj.stop_reason == "max_assistant_turns" and len(traj.turns) == 3
    assert traj.turns[-1].obs_end == traj.turns[-1].gen_end == len(traj.response_ids)  # no dangling observation
    assert_mask(traj, tok.convert_tokens_to_ids("<|im_end|>"))


async def test_response_budget_counts_all_turns_and_never_cuts_observations(chat_tokenizer, rollout_cfg):
    tok = chat_tokenizer
    engine = scripted_engine(tok, [call_text("calculator", '{"expression": "1+1"}')])
    tools = {"calculator": CalculatorTool()}
    first = len(engine.reply_ids(call_text("calculator", '{"expression": "1+1"}')))
    for budget in (first - 3, first + 5, 3 * first + 30):
        rollout_cfg.multi_turn.max_assistant_turns = None
        traj = await one(loop(tok, engine, rollout_cfg, tools, max_response_length=budget))
        assert traj.stop_reason == "response_budget"
        assert len(traj.response_ids) <= budget
        assert traj.turns[-1].obs_end == len(traj.response_ids)
        assert_token_exact(tok, traj, tools) if traj.response_ids[-1] == engine.eos_id else None


class GuessInteraction(BaseInteraction):
    """Says "Wrong" until the model answers 444; counts finalize calls."""

    finalized = 0

    async def generate_response(self, instance_id, messages, **kwargs):
        last = messages[-1]["content"]
        if "444" in last:
            self.instances[instance_id]["score"] = 1.0
            return True, "Correct!", 1.0, {}
        return False, "Wrong answer, please try again.", 0.0, {}

    async def finalize_interaction(self, instance_id, **kwargs):
        type(self).finalized += 1
        await super().finalize_interaction(instance_id, **kwargs)


async def test_interaction_turns_and_reward(chat_tokenizer, rollout_cfg):
    tok = chat_tokenizer
    engine = scripted_engine(tok, ["It is 400.", "It is 444."])
    inter = {"guess": GuessInteraction({"name": "guess"})}
    GuessInteraction.finalized = 0
    s = sample(interaction_kwargs={"name": "guess"})
    traj = (await loop(tok, engine, rollout_cfg, interactions=inter).run([s], 1, SP)).trajectories[0]
    assert traj.stop_reason == "interaction_done" and traj.reward == 1.0
    assert [m.role for m in traj.messages] == ["user", "assistant", "user", "assistant"]
    assert [t.score for t in traj.turns] == [0.0, 1.0]
    assert_token_exact(tok, traj, None)
    assert_mask(traj, tok.convert_tokens_to_ids("<|im_end|>"))
    rollout_cfg.multi_turn.max_user_turns = 0
    traj = (await loop(tok, engine, rollout_cfg, interactions=inter).run([s], 1, SP)).trajectories[0]
    assert traj.stop_reason == "max_user_turns"
    assert GuessInteraction.finalized == 2


async def test_a_turn_limit_still_shows_the_final_reply_to_the_interaction(chat_tokenizer, rollout_cfg):
    """When max_assistant_turns or max_user_turns ends the episode, the interaction still sees the final reply:
    the reward and that turn's score are of the correct final answer (1.0, not the previous reply's 0.0). Its
    follow-up message is dropped: same stop reason, messages and tokens as without the call."""
    tok = chat_tokenizer
    engine = scripted_engine(tok, ["It is 400.", "It is 444."])
    s = sample(interaction_kwargs={"name": "guess"})
    for turns, user_turns, stop in ((2, None, "max_assistant_turns"), (None, 1, "max_user_turns")):
        rollout_cfg.multi_turn.max_assistant_turns, rollout_cfg.multi_turn.max_user_turns = turns, user_turns
        inter = {"guess": GuessInteraction({"name": "guess"})}
        traj = (await loop(tok, engine, rollout_cfg, interactions=inter).run([s], 1, SP)).trajectories[0]
        assert (traj.stop_reason, traj.reward, traj.outcome) == (stop, 1.0, "ok")
        assert [t.score for t in traj.turns] == [0.0, 1.0]
        assert [m.role for m in traj.messages] == ["user", "assistant", "user", "assistant"]
        assert traj.turns[-1].obs_end == traj.turns[-1].gen_end == len(traj.response_ids)  # no follow-up appended
        assert traj.metrics["num_user_turns"] == 1.0
        assert_token_exact(tok, traj, None)
        assert_mask(traj, tok.convert_tokens_to_ids("<|im_end|>"))


async def test_each_turn_of_a_seeded_trajectory_draws_its_own_noise(chat_tokenizer, rollout_cfg):
    """A seeded trajectory's turns get distinct seeds (turn 0 keeps the trajectory's). One seed replayed every
    turn replays the same random numbers: on a quiz tried for examples/turn_credit (six keys, each answered with a
    number 1..7) a warm start near-uniform over the answers repeated its first answer in all six turns of 61 of 64
    trajectories; with a seed per turn, in none."""
    tok = chat_tokenizer
    seen: list[int] = []

    def script(prompt_ids, sampling):
        seen.append(sampling.seed)
        return "It is 400."  # always wrong: the interaction asks again until max_user_turns

    engine = ScriptedEngine(tok, script, tok.convert_tokens_to_ids("<|im_end|>"))
    rollout_cfg.multi_turn.max_user_turns = 2
    s = sample(interaction_kwargs={"name": "guess"})
    batch = await loop(tok, engine, rollout_cfg, interactions={"guess": GuessInteraction({"name": "guess"})}).run(
        [s], 2, SamplingParams(max_new_tokens=200, seed=7))
    assert [len(t.turns) for t in batch.trajectories] == [3, 3]
    want = [7, turn_seed(7, 1), turn_seed(7, 2), 8, turn_seed(8, 1), turn_seed(8, 2)]
    assert sorted(seen) == sorted(want) and len(set(seen)) == 6  # no two turns of the batch share a seed
    assert SamplingParams(seed=7).for_turn(0).seed == 7 and SamplingParams().for_turn(3).seed is None
    assert all(0 <= x < 2**63 for x in seen)


async def test_an_empty_reply_is_the_policys_turn_not_an_infra_failure(chat_tokenizer, rollout_cfg):
    """The template renders an empty assistant message as "<|im_start|>assistant<|im_end|>" (no newline, as
    Qwen2.5's does), not a continuation of the generation prompt; the observation still follows exactly."""
    tok = chat_tokenizer
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    engine = scripted_engine(tok, ["", "It is 444."])
    s = sample(interaction_kwargs={"name": "guess"})
    traj = (await loop(tok, engine, rollout_cfg, interactions={"guess": GuessInteraction({"name": "guess"})})
            .run([s], 1, SP)).trajectories[0]  # fmt: skip
    assert traj.outcome == "ok" and traj.stop_reason == "interaction_done" and traj.reward == 1.0
    first = traj.turns[0]
    assert traj.response_ids[first.gen_start : first.gen_end] == [eos]  # the whole empty reply
    obs = tok.decode(traj.response_ids[first.gen_end : first.obs_end])
    assert obs == "\n<|im_start|>user\nWrong answer, please try again.<|im_end|>\n<|im_start|>assistant\n"
    assert_mask(traj, eos)


async def test_failures_stay_in_their_trajectory(chat_tokenizer, rollout_cfg):
    tok = chat_tokenizer

    def reply(text, k):
        if "boom" in text:
            raise RuntimeError("engine exploded")
        return "fine"

    engine = scripted_engine(tok, reply)
    inter = {"guess": GuessInteraction({"name": "guess"})}
    samples = [sample("boom", uid="a"), sample("ok", uid="b"), sample(uid="c", interaction_kwargs={"name": "nope"})]
    batch = await loop(tok, engine, rollout_cfg, interactions=inter).run(samples, 1, SP)
    a, b, c = batch.trajectories
    assert (a.stop_reason, a.outcome, a.cause) == ("error", "infra_failure", "engine_error")
    assert "engine exploded" in a.error
    assert b.stop_reason == "end_of_turn" and b.error is None and b.outcome == "policy_failure"
    assert c.stop_reason == "error" and "nope" in c.error and c.outcome == "infra_failure"


async def test_reward_function_error_is_an_infra_failure(chat_tokenizer, rollout_cfg):
    def broken(data_source, solution_str, ground_truth, extra_info=None):
        raise ValueError("scorer bug")

    tok = chat_tokenizer
    traj = await one(loop(tok, scripted_engine(tok, ["42"]), rollout_cfg, reward=load_reward_fn(broken)))
    assert (traj.outcome, traj.cause) == ("infra_failure", "reward_error") and "scorer bug" in traj.error


async def test_success_is_ok_and_budget_is_a_policy_failure(chat_tokenizer, rollout_cfg):
    tok = chat_tokenizer
    ok = await one(loop(tok, scripted_engine(tok, ["it is 42"]), rollout_cfg, reward=load_reward_fn(answer_reward)),
                   sample(ground_truth="42"))
    assert (ok.outcome, ok.cause, ok.reward) == ("ok", None, 1.0)
    long = await one(loop(tok, scripted_engine(tok, ["x " * 50]), rollout_cfg, max_response_length=8))
    assert (long.stop_reason, long.outcome, long.cause) == ("response_budget", "policy_failure", "budget_exhausted")


async def test_a_prompt_too_long_with_tools_names_the_tool_block(chat_tokenizer, rollout_cfg, caplog):
    """The chat template renders every tool schema into every prompt: a prompt the tools push past
    data.max_prompt_length says how many of its tokens they take (refused), or warns once (filtered)."""
    from verl_agent.chat import ChatEncoder
    from verl_agent.rollout.tool_budget import tool_tokens

    tok, tools = chat_tokenizer, {"calculator": CalculatorTool()}
    schema = [CalculatorTool().get_openai_tool_schema().to_openai()]
    block = tool_tokens(tok, schema)
    bare = len(ChatEncoder(tok).encode_prompt(sample().messages))
    assert block > 0
    limit = bare + block // 2  # fits without the tools, not with them
    refused = AgentLoop(scripted_engine(tok, ["x"]), tok, rollout_cfg, tools=tools, max_prompt_length=limit,
                        max_response_length=10)
    traj = (await refused.run([sample()], 1, SP)).trajectories[0]
    assert traj.cause == "prompt_too_long" and f"{block} of them the schemas of 1 tools" in traj.error
    filtered = AgentLoop(scripted_engine(tok, ["x"]), tok, rollout_cfg, tools=tools, max_prompt_length=limit,
                         max_response_length=10, overlong_prompts="filter")
    with caplog.at_level("WARNING", logger="verl_agent.rollout.agent_loop"):
        batch = await filtered.run([sample()], 3, SP)
    assert all(t.outcome == "filtered" for t in batch.trajectories)
    warnings = [r.getMessage() for r in caplog.records if "filtered out" in r.getMessage()]
    assert len(warnings) == 1 and f"{block} of them the schemas" in warnings[0]


@pytest.mark.parametrize("policy", ["error", "filter", "left", "right"])
async def test_overlong_prompt_policies(chat_tokenizer, rollout_cfg, policy):
    tok = chat_tokenizer
    lp = AgentLoop(scripted_engine(tok, ["x"]), tok, rollout_cfg, max_prompt_length=5, max_response_length=10,
                   overlong_prompts=policy)
    traj = (await lp.run([sample()], 1, SP)).trajectories[0]
    from verl_agent.chat import ChatEncoder

    full = list(ChatEncoder(tok).encode_prompt(sample().messages))
    assert len(full) > 5
    if policy == "error":
        assert (traj.outcome, traj.cause, traj.stop_reason) == ("infra_failure", "prompt_too_long", "prompt_too_long")
        assert "data.max_prompt_length=5" in traj.error and "filter_overlong_prompts" in traj.error
    elif policy == "filter":
        assert (traj.outcome, traj.stop_reason) == ("filtered", "prompt_too_long") and not traj.response_ids
    else:
        assert traj.prompt_ids == (full[-5:] if policy == "left" else full[:5]) and traj.response_ids


async def test_slow_tools_overlap(chat_tokenizer, rollout_cfg):
    """64 trajectories whose tool sleeps 1 s each finish in a few seconds, not 64."""
    tok = chat_tokenizer
    engine = scripted_engine(tok, [call_text("echo", '{"text": "z"}'), "done"])
    echo = CountingTool(delay=1.0)
    start = time.perf_counter()
    batch = await loop(tok, engine, rollout_cfg, {"echo": echo}).run([sample(uid=str(i)) for i in range(64)], 1, SP)
    elapsed = time.perf_counter() - start
    assert all(t.stop_reason == "end_of_turn" for t in batch.trajectories)
    assert echo.peak == 64 and echo.created == echo.released == 64
    assert elapsed < 10, elapsed  # sequential would be 64 s


async def test_cancelled_rollout_still_releases(chat_tokenizer, rollout_cfg):
    tok = chat_tokenizer
    engine = scripted_engine(tok, [call_text("echo", '{"text": "z"}'), "done"])
    echo = CountingTool(delay=5.0)
    task = asyncio.ensure_future(loop(tok, engine, rollout_cfg, {"echo": echo}).run([sample()], 3, SP))
    await asyncio.sleep(0.3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert echo.created == echo.released == 3


async def test_each_trajectory_is_one_engine_session_released_at_the_end(chat_tokenizer, rollout_cfg):
    """Turns of one trajectory share a session id (KV reuse); ids differ across trajectories; all are released."""
    tok = chat_tokenizer
    engine = scripted_engine(tok, [call_text("calculator", '{"expression": "1+1"}'), "2"])
    seen, released = [], []
    inner = engine.generate

    async def generate(ids, sp, *, session=None):
        seen.append(session)
        return await inner(ids, sp, session=session)

    async def release_session(session):
        released.append(session)

    engine.generate, engine.release_session = generate, release_session
    batch = await loop(tok, engine, rollout_cfg, {"calculator": CalculatorTool()}).run([sample()], 3, SP)
    assert all(len(t.turns) == 2 for t in batch.trajectories)
    assert len(seen) == 6 and len(set(seen)) == 3 and all(s.startswith("s0/") for s in seen)
    assert sorted(released) == sorted(set(seen))
