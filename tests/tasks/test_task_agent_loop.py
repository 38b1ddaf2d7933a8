"""The training path: task samples from data.train_files (a task folder or a JSONL of task paths), the
container tools from tool YAML, the agent loop (scripted engine) calling bash / str_replace_editor /
submit in one container per trajectory, the reward from the task's tests, infra failures by cause."""

from __future__ import annotations

import json

import pytest
from task_helpers import make_task, needs_docker
from model_helpers import call_text, scripted_engine

from verl_agent.data import DataError, iter_samples, load_samples
from verl_agent.engine.contract import SamplingParams
from verl_agent.rollout.agent_loop import AgentLoop
from verl_agent.tools.registry import build_tools

pytestmark = [needs_docker, pytest.mark.docker]

TOOLS = [{"class_name": "verl_agent.tasks.tools.BashTool", "config": {"type": "native", "timeout": 30, "warm": 0}},
         {"class_name": "verl_agent.tasks.tools.EditorTool", "config": {"type": "native"}},
         {"class_name": "verl_agent.tasks.tools.SubmitTool", "config": {"type": "native"}}]


def test_task_folders_and_jsonl_rows_are_samples(tmp_path, count_task):
    (s,) = load_samples(count_task)  # one task directory
    assert s.messages[0].content == "Write the number of lines of /app/input.txt to /app/count.txt."
    assert s.tools_kwargs["bash"] == {"create_kwargs": {"task_dir": str(count_task)}}
    assert s.extra_info["task_name"] == "count-lines" and s.uid == "count-lines"
    rows = tmp_path / "train.jsonl"
    rows.write_text(json.dumps({"task": str(count_task), "difficulty": 2}) + "\n"
                    + json.dumps({"task": "missing-task"}) + "\n")
    samples = list(iter_samples(rows, skip_bad_rows=True))
    assert len(samples) == 1 and samples[0].extra_info["difficulty"] == 2
    with pytest.raises(DataError, match=r"train.jsonl:2: .*missing-task: not a task directory"):
        load_samples(rows)
    (tmp_path / "suite").mkdir()
    make_task(tmp_path / "suite", "a")
    make_task(tmp_path / "suite", "b")
    assert [x.uid for x in load_samples(tmp_path / "suite")] == ["a", "b"]


async def test_agent_loop_solves_a_task_with_the_container_tools(chat_tokenizer, rollout_cfg, count_task):
    from verl_agent.tasks import env
    from verl_agent.tasks.pool import ContainerPool

    pool = ContainerPool(warm=0)  # closed below: what it leaves is part of the test

    tok = chat_tokenizer
    tools = build_tools(TOOLS)
    replies = [
        call_text("bash", '{"command": "cd /app && wc -l < input.txt"}'),
        call_text("str_replace_editor", '{"command": "create", "path": "/app/count.txt", "file_text": "2"}'),
        call_text("submit", "{}"),
        "never generated: submit ended the episode",
    ]
    rollout_cfg.multi_turn.enable = True
    rollout_cfg.multi_turn.format = "hermes"
    agent = AgentLoop(scripted_engine(tok, replies), tok, rollout_cfg, tools=tools, max_prompt_length=4096,
                      max_response_length=4096)
    (sample,) = load_samples(count_task)
    with env.using_pool(pool):  # the module's pool: no second pool for this test
        batch = await agent.run([sample], 2, SamplingParams(max_new_tokens=200))
    for traj in batch.trajectories:
        assert (traj.reward, traj.outcome, traj.stop_reason) == (1.0, "ok", "end_of_turn")
        assert traj.metrics["verifier/seconds"] > 0
        tool_msgs = [m.content for m in traj.messages if m.role == "tool"]
        assert tool_msgs[0] == "2\n[exit code 0]" and tool_msgs[1] == "File created successfully at: /app/count.txt"
        assert len(traj.turns) == 3
        for t in traj.turns:  # tool results are observations: never trained on
            assert set(traj.loss_mask[t.gen_end:t.obs_end]) <= {0}
    assert not env._envs and not env._refs  # every trajectory released its container
    mine = {"label": f"verl-agent.tasks.run={pool.run_id}"}
    left = pool.runtime.client.containers.list(all=True, ignore_removed=True, filters=mine)
    await pool.close()  # removals are in flight; close waits for them
    assert len(left) <= 2 and not pool.runtime.client.containers.list(all=True, ignore_removed=True, filters=mine)


async def test_a_verifier_timeout_is_a_zero_charged_to_the_agent(chat_tokenizer, rollout_cfg, tmp_path):
    from verl_agent.tasks import env
    from verl_agent.tasks.pool import ContainerPool

    own = ContainerPool(warm=0)
    d = make_task(tmp_path, "slow-verifier", test_sh="#!/bin/bash\nsleep 20\n", verifier_timeout=1.0)
    rollout_cfg.multi_turn.enable = True
    rollout_cfg.multi_turn.format = "hermes"
    agent = AgentLoop(scripted_engine(chat_tokenizer, [call_text("submit", "{}")]), chat_tokenizer, rollout_cfg,
                      tools=build_tools(TOOLS), max_prompt_length=4096, max_response_length=1024)
    try:
        with env.using_pool(own):
            (traj,) = (await agent.run(load_samples(d), 1, SamplingParams(max_new_tokens=100))).trajectories
    finally:
        own.close_sync()
    assert traj.reward == 0.0 and traj.outcome != "infra_failure"
    assert traj.metrics["verifier/agent_verifier_timeout"] == 1.0


async def test_the_task_as_an_interaction(chat_tokenizer, rollout_cfg, count_task, pool):
    from verl_agent.interactions.registry import build_interactions
    from verl_agent.tasks import env

    replies = ["Let me look.\n```bash\ncd /app; wc -l < input.txt\n```",
               "```bash\necho 2 > count.txt && cat count.txt\n```", "Done."]
    inter = build_interactions([{"name": "harbor", "class_name": "verl_agent.tasks.interaction.TaskInteraction",
                                 "config": {"timeout": 30}}])
    agent = AgentLoop(scripted_engine(chat_tokenizer, replies), chat_tokenizer, rollout_cfg, interactions=inter,
                      max_prompt_length=4096, max_response_length=2048)
    with env.using_pool(pool):
        (traj,) = (await agent.run(load_samples(count_task), 1, SamplingParams(max_new_tokens=100))).trajectories
    assert (traj.reward, traj.outcome, traj.stop_reason) == (1.0, "ok", "interaction_done")
    users = [m.content for m in traj.messages if m.role == "user"]
    assert users[1].startswith("You are in a Linux container") and users[2:] == ["2\n[exit code 0]",
                                                                               "2\n[exit code 0]"]


async def test_the_agents_time_limit_ends_the_episode(chat_tokenizer, rollout_cfg, tmp_path, pool):
    from verl_agent.tasks import env

    d = make_task(tmp_path, "short-limit", agent_timeout=1.0)
    replies = [call_text("bash", '{"command": "sleep 5; echo 2 > /app/count.txt"}'),
               call_text("bash", '{"command": "echo 2 > /app/count.txt"}'), "never generated"]
    rollout_cfg.multi_turn.enable = True
    rollout_cfg.multi_turn.format = "hermes"
    agent = AgentLoop(scripted_engine(chat_tokenizer, replies), chat_tokenizer, rollout_cfg, tools=build_tools(TOOLS),
                      max_prompt_length=4096, max_response_length=2048)
    with env.using_pool(pool):
        (traj,) = (await agent.run(load_samples(d), 1, SamplingParams(max_new_tokens=100))).trajectories
    tool_msgs = [m.content for m in traj.messages if m.role == "tool"]
    assert "Killed" in tool_msgs[0] and "2 >" not in tool_msgs[0]
    assert tool_msgs[0].endswith(" s and was killed; exit code 137]")  # the time limit cut the command
    assert float(tool_msgs[0].split("timed out after ")[1].split(" s")[0]) <= 1.0
    assert len(traj.turns) == 2 and traj.stop_reason == "end_of_turn"  # the refused call ended the episode
    assert (traj.reward, traj.outcome) == (0.0, "policy_failure")


async def test_an_interactions_infrastructure_failure_keeps_its_cause(chat_tokenizer, rollout_cfg, tmp_path, pool):
    from verl_agent.interactions.registry import build_interactions
    from verl_agent.tasks import env

    d = make_task(tmp_path, "no-reward-i", test_sh="#!/bin/bash\necho wrote no reward\n")
    inter = build_interactions([{"name": "harbor", "class_name": "verl_agent.tasks.interaction.TaskInteraction"}])
    agent = AgentLoop(scripted_engine(chat_tokenizer, ["Done."]), chat_tokenizer, rollout_cfg, interactions=inter,
                      max_prompt_length=4096, max_response_length=1024)
    with env.using_pool(pool):
        (traj,) = (await agent.run(load_samples(d), 1, SamplingParams(max_new_tokens=50))).trajectories
    assert (traj.outcome, traj.cause, traj.reward) == ("infra_failure", "verifier_error", 0.0)
