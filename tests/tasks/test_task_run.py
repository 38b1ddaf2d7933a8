"""End to end: a Harbor-layout task through `verl-agent tasks run` (oracle 1, nop 0), image caching,
reward.json metrics, verifier env/user, infrastructure failures by cause, and `tasks check`."""

from __future__ import annotations

import json

import pytest
from task_helpers import make_task, needs_docker

from verl_agent.cli import main
from verl_agent.tasks.grading import GradingError, grade
from verl_agent.tasks.runner import run_task
from verl_agent.data.harbor import load_task

pytestmark = [needs_docker, pytest.mark.docker]


def _last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_tasks_run_oracle_scores_1_and_nop_0_and_the_image_is_built_once(count_task, capsys):
    assert main(["tasks", "run", str(count_task), "--agent", "oracle"]) == 0
    first = _last_json(capsys)
    assert first["reward"] == 1.0 and first["outcome"] == "ok" and first["image"].startswith("verl-agent-task:")
    assert {"image_s", "start_s", "agent_s", "grade_s", "total_s"} <= set(first["timings"])
    assert main(["tasks", "run", str(count_task), "--agent", "nop"]) == 0
    second = _last_json(capsys)
    assert second["reward"] == 0.0 and second["image"] == first["image"] and second["image_built"] is False


async def test_reward_json_metrics_verifier_env_and_user(tmp_path, pool):
    test_sh = ('#!/bin/bash\nok=$([ "$(cat /app/count.txt 2>/dev/null)" = "$EXPECT" ] && echo 1 || echo 0)\n'
               'printf \'{"reward": %s, "uid": %s, "checks": 2, "note": "x"}\' "$ok" "$(id -u)" '
               '> /logs/verifier/reward.json\n')
    d = make_task(tmp_path, "json-reward", test_sh=test_sh,
                  verifier_extra='user = "10001"\nenv = { EXPECT = "2" }\n')
    run = await run_task(d, "oracle", pool=pool)
    assert (run.reward, run.metrics, run.outcome) == (1.0, {"uid": 10001.0, "checks": 2.0}, "ok")


async def test_a_verifier_without_a_reward_is_infrastructure_not_zero(tmp_path, pool):
    d = make_task(tmp_path, "no-reward", test_sh="#!/bin/bash\necho forgot the reward\n", verifier_timeout=5.0)
    run = await run_task(d, "oracle", pool=pool)
    assert (run.reward, run.outcome, run.cause) == (None, "infra_failure", "verifier_error")
    assert "forgot the reward" in run.error  # what test.sh printed says why


async def test_a_verifier_timeout_is_the_agents_zero(tmp_path, pool):
    """What the verifier hangs on is the agent's final state: charged to it, never a way out of its 0."""
    d = make_task(tmp_path, "slow", test_sh="#!/bin/bash\nsleep 30\n", verifier_timeout=1.0)
    run = await run_task(d, "oracle", pool=pool)
    assert (run.reward, run.outcome, run.metrics) == (0.0, "ok", {"agent_verifier_timeout": 1.0})


async def test_a_dead_container_is_an_infrastructure_failure(count_task, pool):
    task = load_task(count_task)
    box = await pool.acquire(task)
    pool.runtime.client.api.kill(box.id)  # from outside: nothing the agent can do
    with pytest.raises(GradingError) as e:
        grade(pool.runtime, box, task)
    assert e.value.cause == "container_dead"
    await pool.release(box)


async def test_task_errors_name_the_problem(tmp_path, pool):
    d = make_task(tmp_path, "no-base", dockerfile="FROM python:3.12-slim-missing-here\nRUN true\n")
    run = await run_task(d, "oracle", pool=pool)
    assert run.outcome == "error" and run.cause == "ImageError"
    assert "python:3.12-slim-missing-here" in run.error and "verl-agent tasks build-bases" in run.error


def test_tasks_check_lists_tasks_whose_oracle_or_nop_is_wrong(tmp_path, count_task, capsys):
    """Each flagged task with what its verifier said; a test.sh that writes no reward when the tests fail is
    flagged by its nop run (else every failing trajectory would be an infrastructure failure)."""
    root = tmp_path / "suite"
    make_task(root, "good")
    make_task(root, "bad-oracle", solve="#!/bin/bash\necho 3 > /app/count.txt\n",
              test_sh="#!/bin/bash\necho \"count is $(cat /app/count.txt)\"\necho 0 > /logs/verifier/reward.txt\n")
    make_task(root, "no-reward-on-fail", test_sh='#!/bin/bash\nif [ "$(cat /app/count.txt 2>/dev/null)" = "2" ]; '
                                                 'then echo 1 > /logs/verifier/reward.txt; fi\n')
    assert main(["tasks", "check", str(root), "--jobs", "4"]) == 1
    out = capsys.readouterr().out
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary == {"tasks": 3, "failed": 2, "failed_tasks": [str(root / "bad-oracle"),
                                                                 str(root / "no-reward-on-fail")]}
    assert f"FAIL  {root / 'bad-oracle'}  oracle scored 0.0\n    oracle run, verifier output:\n      count is 3\n" in out
    assert f"ok    {root / 'good'}" in out
    line = next(x for x in out.splitlines() if x.startswith(f"FAIL  {root / 'no-reward-on-fail'}"))
    assert "nop run has no reward file (test.sh wrote neither /logs/verifier/reward.txt nor reward.json" in line
    assert line.endswith("test.sh must write 0 to /logs/verifier/reward.txt when the tests fail, or every failing "
                         "trajectory is an infrastructure failure, left out of the loss")
    assert "test.sh (exit 0) printed: (nothing)" in line  # what the verifier said, kept


async def test_model_agent_through_an_openai_compatible_url(chat_tokenizer, count_task, pool):
    """--agent model --model http://...: a chat-completions server (the project's own endpoint over a scripted
    engine) drives bash and submit in the task's container; the tests grade it."""
    from model_helpers import call_text, scripted_engine

    from verl_agent.engine.contract import SamplingParams
    from verl_agent.parsers import get_parser
    from verl_agent.rollout.openai.openai_server import OpenAIServer

    replies = [call_text("bash", '{"command": "wc -l < /app/input.txt > /app/count.txt"}'), call_text("submit", "{}")]
    server = OpenAIServer(scripted_engine(chat_tokenizer, replies), chat_tokenizer, get_parser("hermes"),
                          max_prompt_length=4096, max_response_length=1024)
    await server.start()
    try:
        rec = server.open_session(SamplingParams(max_new_tokens=100), uid="u0")
        run = await run_task(count_task, "model", pool=pool, model=server.base_url(rec.sid), max_turns=5)
    finally:
        await server.stop()
    assert (run.reward, run.outcome, run.metrics["turns"]) == (1.0, "ok", 2)
    assert "[tool] (no output)\n[exit code 0]\n[assistant]" in run.agent_output
