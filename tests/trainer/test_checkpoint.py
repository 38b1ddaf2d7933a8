"""Save/resume: a run resumed from a checkpoint continues the metrics of an uninterrupted run exactly (the
resumed run's checkpoints written with zstd byte planes, the uninterrupted run's without).

Also checks the exported Hugging Face model loads with from_pretrained and equals the trained policy's
behaviour (it is what the engine serves after the last sync).
"""

from __future__ import annotations

import json
import shutil

import pytest

from verl_agent.trainer.persistence import checkpoint as ckpt
from verl_agent.trainer.loop import train

pytestmark = pytest.mark.slow

KEYS = ["rollout/reward/mean", "rollout/response_length/mean", "actor/entropy", "actor/pg_loss", "actor/grad_norm"]


def _steps(run_dir):
    lines = [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {d["step"]: d for d in lines if "actor/pg_loss" in d}


def test_resume_continues_the_same_metrics(ray_cluster, make_cfg, dev_model_path, tmp_path):
    common = [f"actor_rollout_ref.model.path={dev_model_path}", "data.val_files=[]", "trainer.save_freq=1",
              "data.max_response_length=48", "actor_rollout_ref.actor.optim.lr=1e-3"]
    full = train(make_cfg(*common, "trainer.total_training_steps=3", run_dir=tmp_path / "full"))
    part, zstd = tmp_path / "part", "trainer.checkpoint_compression=zstd"  # the resumed run reads byte planes
    train(make_cfg(*common, zstd, "trainer.total_training_steps=2", run_dir=part))
    assert ckpt.latest_checkpoint(part).name == "global_step_2"
    index = json.loads((ckpt.latest_checkpoint(part) / "actor" / "rank0.json").read_text())
    assert index["codec"] == "zstd" and all("zstd_frames" in e for e in index["tensors"].values())
    resumed = train(make_cfg(*common, zstd, "trainer.total_training_steps=3", run_dir=part))
    assert resumed.resumed_from == 2
    a, b = _steps(full.run_dir), _steps(part)
    assert sorted(b) == [1, 2, 3]
    for step in (1, 2, 3):
        for k in KEYS:
            assert b[step][k] == pytest.approx(a[step][k], rel=1e-4, abs=1e-6), (step, k)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(resumed.export_dir)
    assert AutoTokenizer.from_pretrained(resumed.export_dir) is not None
    assert sum(p.numel() for p in model.parameters()) > 0
    assert (part / "config.yaml").is_file() and any((part / "tensorboard").iterdir())


@pytest.mark.timeout(300)  # before the fix, step 2 dropped every group as stale forever
def test_resume_path_with_any_folder_name_keeps_the_policy_version(ray_cluster, make_cfg, tmp_path):
    """trainer.resume_mode=resume_path from a checkpoint folder not named global_step_N: the engine's policy
    version is the checkpoint's step (its driver_state.json), so step 2 rolls out under version 1 and trains."""
    common = ["data.val_files=[]", "data.max_response_length=48", "trainer.save_freq=1"]
    train(make_cfg(*common, "trainer.total_training_steps=1", run_dir=tmp_path / "first"))
    renamed = tmp_path / "best_so_far"
    shutil.copytree(ckpt.latest_checkpoint(tmp_path / "first"), renamed)
    run = tmp_path / "resumed"
    resumed = train(make_cfg(*common, "trainer.total_training_steps=2", "trainer.resume_mode=resume_path",
                             f"trainer.resume_from_path={renamed}", run_dir=run))
    assert resumed.resumed_from == 1 and len(resumed.history) == 1
    assert resumed.history[0]["rollout/num_trajectories"] == 16.0  # nothing dropped as stale
    records = [json.loads(line) for line in (run / "trajectories" / "step_2.jsonl").open()]
    assert len(records) == 16 and {r["policy_version"] for r in records} == {1}
