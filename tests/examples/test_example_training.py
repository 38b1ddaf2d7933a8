"""Every example trains for one step on the tiny model through the real trainer (Ray, FSDP worker, HF engine).

Plumbing, not learning: tiny batch sizes via config overrides; the assertions are that each example's
tools / interactions / reward load inside the Ray workers, rollouts finish without errors, a loss is
computed, and metrics (training and validation) are written. One local Ray instance serves the module;
the code_interpreter example gets a process-backend sandbox on a free loopback port.
"""

from __future__ import annotations

import json
import math
import os
import tempfile

import pytest
from example_helpers import NAMES, SandboxProcess, example_config, tools_yaml_with_url

from verl_agent.trainer.loop import train

pytestmark = pytest.mark.slow

SMALL = ["data.train_batch_size=2", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
         "data.max_response_length=64", "data.val_batch_size=4", "trainer.total_training_steps=1",
         "trainer.num_cpu_workers=1", "trainer.logger=[console]", "trainer.val_before_train=false",
         "trainer.resume_mode=disable"]


@pytest.fixture(scope="module")
def sandbox():
    with SandboxProcess("process") as server:
        yield server


@pytest.fixture(scope="module")
def ray_local(sandbox):
    """One local Ray for the module (reused if a test session already started one); workers get the sandbox URL."""
    import ray

    mp = pytest.MonkeyPatch()
    mp.setenv("SANDBOX_FUSION_URL", sandbox.url)  # the driver's reward calls (none today) and local workers
    started = not ray.is_initialized()
    if started:
        mp.setenv("RAY_TMPDIR", os.environ.get("RAY_TMPDIR", os.path.join(tempfile.gettempdir(), "ray")))
        mp.setenv("RAY_AUTH_MODE", os.environ.get("RAY_AUTH_MODE", "disabled"))
        ray.init(address="local", include_dashboard=False, runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false",
                                                                    "SANDBOX_FUSION_URL": sandbox.url}})
    yield
    if started:
        ray.shutdown()
    mp.undo()


@pytest.mark.parametrize("name", NAMES)
def test_example_trains_one_step(name, ray_local, sandbox, tiny_model_path, tmp_path):
    extra = []
    if name == "code_interpreter":
        tools = tools_yaml_with_url(tmp_path, sandbox.url)
        extra.append(f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}")
    cfg = example_config(name, *SMALL, *extra, f"trainer.default_local_dir={tmp_path / 'run'}",
                         model_path=tiny_model_path)
    result = train(cfg)
    assert result.steps == 1 and len(result.history) == 1
    step = result.history[0]
    assert step["rollout/num_trajectories"] == 4 and step["rollout/infra_failed"] == 0.0
    assert math.isfinite(step["actor/pg_loss"])
    assert result.val_after["val/num_trajectories"] >= 4 and result.val_after["val/infra_failed"] == 0.0
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["step"] == 1 and "rollout/reward/mean" in lines[0]
    assert any("val/success_rate" in x for x in lines)
    assert (result.export_dir / "config.json").is_file()
