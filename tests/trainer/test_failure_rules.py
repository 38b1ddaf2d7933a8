"""Infrastructure failures in a real training run: excluded from the loss, counted per cause, logged, and fatal
above trainer.max_infra_failure_fraction. Real Ray, gloo, FSDP2 and the tiny model; the faults are a calculator
tool whose own code raises (on some calls) and a reward function that raises (engine errors are classified the same way by the
agent loop: tests/rollout/test_agent_loop.py::test_failures_stay_in_their_trajectory).
"""

from __future__ import annotations

import json
import math

import pytest
import yaml

from verl_agent.trainer.loop import TrainingError, train

pytestmark = pytest.mark.slow

FAULTS = '''
from verl_agent.models.calculator_task import calculator_reward
from verl_agent.tools.calculator import CalculatorTool


def reward(data_source, solution_str, ground_truth, extra_info=None):
    if {fail_reward}:
        raise ZeroDivisionError("scorer bug on " + str(ground_truth))
    return calculator_reward(data_source, solution_str, ground_truth, extra_info)


CALLS = [0]


class CrashingCalculator(CalculatorTool):
    async def execute(self, instance_id, parameters, **kwargs):
        CALLS[0] += 1
        if {fail_tool}:
            raise OSError("calculator backend crashed")
        return await super().execute(instance_id, parameters, **kwargs)
'''


def _faulty_cfg(make_cfg, tmp_path, fail_reward: str, fail_tool: str, *overrides: str):
    from verl_agent.models.calculator_task import CALCULATOR_TOOL_SCHEMA

    (tmp_path / "faults.py").write_text(FAULTS.format(fail_reward=fail_reward, fail_tool=fail_tool))
    tools = tmp_path / "tools.yaml"
    tools.write_text(yaml.safe_dump({"tools": [{"class_name": "faults.py:CrashingCalculator", "config": {},
                                                "tool_schema": CALCULATOR_TOOL_SCHEMA}]}))
    return make_cfg("data.val_files=[]", "data.max_response_length=48", "trainer.total_training_steps=1",
                    f"data.reward_fn={tmp_path / 'faults.py'}:reward",
                    f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}", *overrides,
                    run_dir=tmp_path / "run")


def test_infra_failures_are_excluded_counted_and_logged(ray_cluster, make_cfg, tmp_path):
    # the scorer fails on answers ending in an even digit, the tool on every third call (of a worker),
    # so that both causes occur and some groups are still left to train on
    cfg = _faulty_cfg(make_cfg, tmp_path, "int(str(ground_truth)[-1]) % 2 == 0", "CALLS[0] % 3 == 1",
                      "trainer.max_infra_failure_fraction=1.0")
    result = train(cfg)
    m = result.history[0]
    records = [json.loads(line) for line in (tmp_path / "run" / "trajectories" / "step_1.jsonl").open()]
    assert len(records) == m["rollout/num_trajectories"] == 16
    failed = [r for r in records if r["outcome"] == "infra_failure"]
    by_cause = {c: sum(r["cause"] == c for r in failed) for c in ("tool_crash", "reward_error")}
    assert by_cause["tool_crash"] > 0 and by_cause["reward_error"] > 0  # both faults occurred
    assert m["rollout/infra_failed/tool_crash"] == by_cause["tool_crash"]
    assert m["rollout/infra_failed/reward_error"] == by_cause["reward_error"]
    assert m["rollout/infra_failed"] == pytest.approx(len(failed) / 16)
    assert all(r["reward"] == 0.0 and r["error"] for r in failed)
    assert any("calculator backend crashed" in r["error"] for r in failed)
    assert any("scorer bug" in r["error"] for r in failed)
    # excluded from the loss: the update saw only the others (minus groups left with fewer than 2)
    assert m["train/excluded_trajectories"] == len(failed)
    assert m["train/sequences"] <= 16 - len(failed)
    assert m["train/sequences"] > 0 and math.isfinite(m["actor/pg_loss"])


def test_too_many_infra_failures_stop_the_run_naming_the_cause(ray_cluster, make_cfg, tmp_path):
    cfg = _faulty_cfg(make_cfg, tmp_path, "True", "False", "trainer.max_infra_failure_fraction=0.2")
    with pytest.raises(TrainingError) as e:
        train(cfg)
    msg = str(e.value)
    assert "step 1" in msg and "trainer.max_infra_failure_fraction=0.2" in msg
    assert "reward_error" in msg and "scorer bug" in msg  # the main cause and one example's exception
    # the stopped step's failures are in its records (written at once; trained ones wait for their advantages)
    records = [json.loads(line) for line in (tmp_path / "run" / "trajectories" / "step_1.jsonl").open()]
    assert records and all(r["outcome"] == "infra_failure" and "advantages" not in r for r in records)
