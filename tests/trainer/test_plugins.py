"""A user's own estimator and engine, registered from a file the config names in `plugins`, train a step."""

from __future__ import annotations

import pytest

from verl_agent.config import ConfigError
from verl_agent.registry import ADV_ESTIMATORS, ENGINES
from verl_agent.trainer.loop import train

PLUGIN = '''
import os
from pathlib import Path

from verl_agent.registry import ADV_ESTIMATORS, ENGINES
from verl_agent.rollout.build import hf_engine

BUILT = Path(__file__).with_suffix(".engines")


@ADV_ESTIMATORS.register("quarter")
def quarter(inputs):
    """Every model token's advantage is 0.25: no built-in estimator gives that."""
    adv = 0.25 * inputs.response_mask.float()
    return adv, adv


@ENGINES.register("logged_hf")
def logged_hf(rollout, model, device, **kwargs):
    """The hf engine, after a line naming the process that built it."""
    with BUILT.open("a") as f:
        f.write(f"{os.getpid()}\\n")
    return hf_engine(rollout, model, device, **kwargs)
'''


def test_estimator_and_engine_from_a_user_file_train_one_step(ray_cluster, make_cfg, tmp_path):
    plugin = tmp_path / "my_parts.py"
    plugin.write_text(PLUGIN)
    assert "quarter" not in ADV_ESTIMATORS and "logged_hf" not in ENGINES
    with pytest.raises(ConfigError, match="unknown advantage estimator 'quarter'; registered: gae, gigpo, grpo"):
        make_cfg("algorithm.adv_estimator=quarter")
    cfg = make_cfg(f"plugins=[{plugin}]", "algorithm.adv_estimator=quarter", "actor_rollout_ref.rollout.name=logged_hf",
                   "trainer.num_cpu_workers=1", "trainer.total_training_steps=1", "data.val_files=[]",
                   "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2", "data.max_response_length=32",
                   "actor_rollout_ref.actor.ppo_mini_batch_size=2")
    try:
        result = train(cfg)
        (step,) = result.history
        assert step["actor/advantage_abs_mean"] == pytest.approx(0.25)
        assert step["engine/generated_tokens"] > 0
        built = plugin.with_suffix(".engines").read_text().split()
        assert len(built) == 1 and int(built[0]) != __import__("os").getpid()  # built in the Ray worker
    finally:
        ADV_ESTIMATORS.unregister("quarter")
        ENGINES.unregister("logged_hf")
