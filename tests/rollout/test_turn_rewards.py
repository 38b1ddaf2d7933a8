"""Per-turn rewards from every source reach the trainer's turn estimators: an interaction's score per
reply (and its state key), the tools' step rewards per call, a reward function's list per turn.

Scripted engine (every generated token known in advance); the tools, interactions, chat template,
tokenizer and the trainer's preparation code are the real ones.
"""

from __future__ import annotations

import json

import pytest
from model_helpers import CountingTool, call_text, sample, scripted_engine

from verl_agent.interactions.base import BaseInteraction
from verl_agent.protocol import RolloutBatch
from verl_agent.reward import load_reward_fn
from verl_agent.rollout.agent_loop import AgentLoop
from verl_agent.engine.contract import SamplingParams
from verl_agent.rollout.records import trajectory_record, write_records
from verl_agent.trainer.policy.batch import from_trajectory, pad_field
from verl_agent.trainer.policy.prepare import turn_token_rewards

SP = SamplingParams(max_new_tokens=50)


def agent(tok, engine, cfg, **kw):
    return AgentLoop(engine, tok, cfg, max_prompt_length=400, max_response_length=400, **kw)


class Countdown(BaseInteraction):
    """Replies "again" twice (scores 0.1, 0.2, state keys s1, s2), then ends with score 1.0."""

    async def start_interaction(self, instance_id=None, **kwargs):
        self.instances[instance_id] = 0
        return instance_id

    async def generate_response(self, instance_id, messages, **kwargs):
        self.instances[instance_id] += 1
        k = self.instances[instance_id]
        if k == 3:
            return True, "done", 1.0, {}
        return False, "again", 0.1 * k, {"state_key": f"s{k}"}

    async def calculate_score(self, instance_id, **kwargs):
        return 1.3

    async def finalize_interaction(self, instance_id, **kwargs):
        self.instances.pop(instance_id, None)


async def test_interaction_scores_and_state_keys_reach_the_turns(chat_tokenizer, rollout_cfg):
    engine = scripted_engine(chat_tokenizer, ["a", "b", "c"])
    countdown = {"countdown": Countdown({"name": "countdown"})}
    traj = (await agent(chat_tokenizer, engine, rollout_cfg, interactions=countdown)
            .run([sample(interaction_kwargs={"name": "countdown"})], 1, SP)).trajectories[0]
    assert [t.score for t in traj.turns] == pytest.approx([0.1, 0.2, 1.0])
    assert [t.state_key for t in traj.turns] == [None, "s1", "s2"]
    seq = from_trajectory(traj)
    assert seq.turn_keys[1:] == [("state", "s1"), ("state", "s2")]
    rewards = turn_token_rewards([seq], pad_field([seq.loss_mask]))[0]
    ends = [t.gen_end - 1 for t in traj.turns]  # each score on its turn's last model token
    assert rewards[ends].tolist() == pytest.approx([0.1, 0.2, 1.0])
    assert float(rewards.sum()) == pytest.approx(1.3)  # the reward: scores sum to calculate_score here


async def test_tool_step_rewards_per_call_reach_their_turn(chat_tokenizer, rollout_cfg):
    engine = scripted_engine(chat_tokenizer, [call_text("echo", '{"text": "x"}'), "done"])
    traj = (await agent(chat_tokenizer, engine, rollout_cfg, tools={"echo": CountingTool()})
            .run([sample()], 1, SP)).trajectories[0]
    assert [t.score for t in traj.turns] == pytest.approx([0.25, 0.0])  # one call's step reward, on turn 0
    seq = from_trajectory(traj)
    rewards = turn_token_rewards([seq], pad_field([seq.loss_mask]))[0]
    assert float(rewards[traj.turns[0].gen_end - 1]) == pytest.approx(0.25)


async def test_reward_function_list_per_turn(chat_tokenizer, rollout_cfg):
    seen = {}

    def per_turn(data_source, solution_str, ground_truth, extra_info=None):
        seen.update(extra_info)
        return [0.5 if "444" in t else 0.0 for t in extra_info["assistant_turns"]]

    engine = scripted_engine(chat_tokenizer, [call_text("echo", '{"text": "444"}'), "The answer is 444."])
    loop = agent(chat_tokenizer, engine, rollout_cfg, tools={"echo": CountingTool()},
                 reward_fn=load_reward_fn(per_turn))
    traj = (await loop.run([sample(extra_info={"k": 1})], 1, SP)).trajectories[0]
    assert seen["k"] == 1 and len(seen["assistant_turns"]) == 2 and "444" in seen["assistant_turns"][1]
    assert [t.score for t in traj.turns] == [0.5, 0.5] and traj.reward == 1.0 and traj.outcome == "ok"

    def wrong_length(data_source, solution_str, ground_truth, extra_info=None):
        return [1.0]

    engine = scripted_engine(chat_tokenizer, [call_text("echo", '{"text": "1"}'), "done"])
    loop = agent(chat_tokenizer, engine, rollout_cfg, tools={"echo": CountingTool()},
                 reward_fn=load_reward_fn(wrong_length))
    traj = (await loop.run([sample()], 1, SP)).trajectories[0]
    assert traj.outcome == "infra_failure" and traj.cause == "reward_error"
    assert "1 per-turn scores for 2 assistant turns" in traj.error


def test_reward_function_list_is_checked():
    fn = load_reward_fn(lambda text, gt: [0.5, float("nan")])
    res = fn(data_source="d", solution_str="x", ground_truth=None)
    assert res.error and "per-turn list" in res.error and res.turn_scores is None
    res = load_reward_fn(lambda text, gt: {"score": [0.25, 0.5], "acc": 1})(data_source="d", solution_str="x",
                                                                          ground_truth=None)
    assert res.score == 0.75 and res.turn_scores == [0.25, 0.5] and res.info == {"acc": 1.0}


async def test_records_carry_advantages_aligned_with_response_ids(chat_tokenizer, rollout_cfg, tmp_path):
    engine = scripted_engine(chat_tokenizer, ["a", "b", "c"])
    countdown = {"countdown": Countdown({"name": "countdown"})}
    traj = (await agent(chat_tokenizer, engine, rollout_cfg, interactions=countdown)
            .run([sample(interaction_kwargs={"name": "countdown"})], 1, SP)).trajectories[0]
    advs = [0.123456 * (i + 1) for i in range(len(traj.response_ids))]
    rec = trajectory_record(traj, advantages=advs)
    assert len(rec["advantages"]) == len(rec["response_ids"])
    assert all(a == 0.0 for a, m in zip(rec["advantages"], rec["loss_mask"]) if not m)
    assert all(a == round(0.123456 * (i + 1), 4) for i, (a, m) in enumerate(zip(rec["advantages"], rec["loss_mask"]))
               if m)
    path = write_records(tmp_path / "s.jsonl", RolloutBatch([traj, traj]), advantages=[advs, None])
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert "advantages" in lines[0] and "advantages" not in lines[1]
    with pytest.raises(ValueError, match="advantages for"):
        trajectory_record(traj, advantages=advs[:-1])
