"""A short GRPO run on the tiny model improves its reward by a statistically clear margin.

The reward is the calculator tool's own `calc_reward` (no reward function configured, so the agent loop
asks the tools): 1.0 when the trajectory made a successful calculator call. The tiny model calls the
tool in roughly half of its samples at temperature 1, so GRPO has signal from the first step; the test
checks the policy learns to use the tool (a two-proportion z-test between the first and last steps).
"""

from __future__ import annotations

import math

import pytest
import yaml

from verl_agent.trainer.loop import train

pytestmark = pytest.mark.slow

TOOL = '''
from verl_agent.tools.calculator import CalculatorTool


class UsedCalculator(CalculatorTool):
    """Calculator whose trajectory reward is 1.0 once it computed something without error."""

    def __init__(self, config=None, tool_schema=None):
        super().__init__(config, tool_schema)
        self.ok = {}

    async def execute(self, instance_id, parameters, **kwargs):
        response, reward, metrics = await super().execute(instance_id, parameters, **kwargs)
        if not metrics.get("calculator_error"):
            self.ok[instance_id] = True
        return response, reward, metrics

    async def calc_reward(self, instance_id, **kwargs):
        return 1.0 if self.ok.pop(instance_id, False) else 0.0
'''


def _z(p1: float, p2: float, n: int) -> float:
    p = (p1 + p2) / 2
    return (p2 - p1) / math.sqrt(max(p * (1 - p) * 2 / n, 1e-9))


def test_grpo_learns_to_use_the_tool(ray_cluster, make_cfg, tmp_path):
    from verl_agent.models.calculator_task import CALCULATOR_TOOL_SCHEMA

    (tmp_path / "used_tool.py").write_text(TOOL)
    tools = tmp_path / "tools.yaml"
    tools.write_text(yaml.safe_dump({"tools": [{"class_name": "used_tool.py:UsedCalculator", "config": {},
                                                "tool_schema": CALCULATOR_TOOL_SCHEMA}]}))
    steps, batch, n = 10, 8, 8
    result = train(make_cfg(
        "data.reward_fn=null", f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}", "data.val_files=[]",
        f"data.train_batch_size={batch}", f"actor_rollout_ref.rollout.n={n}", f"actor_rollout_ref.actor.ppo_mini_batch_size={batch}",
        "actor_rollout_ref.actor.optim.lr=1e-3", f"trainer.total_training_steps={steps}",
    ))  # fmt: skip
    rewards = [m["rollout/reward/mean"] for m in result.history]
    first, last = sum(rewards[:2]) / 2, sum(rewards[-2:]) / 2
    z = _z(first, last, 2 * batch * n)
    print(f"reward per step: {[round(r, 2) for r in rewards]}  z={z:.1f}")
    assert last - first > 0.2 and z > 3, rewards
