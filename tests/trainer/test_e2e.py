"""End-to-end runs of `train` through Ray: multi-node placement, a dying worker, PPO with a critic."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from verl_agent.trainer.persistence import checkpoint as ckpt
from verl_agent.trainer.loop import TrainingError, train

pytestmark = pytest.mark.slow

FAST = ["data.val_files=[]", "data.max_response_length=48", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2"]


def test_multi_node_cluster_runs_one_step(ray_cluster, make_cfg, dev_model_path):
    """The session cluster has 2 Ray nodes on this machine; nnodes=2 puts one rank on each."""
    result = train(make_cfg(*FAST, f"actor_rollout_ref.model.path={dev_model_path}", "trainer.nnodes=2",
                            "trainer.num_cpu_workers=2", "trainer.total_training_steps=1",
                            "actor_rollout_ref.model.enable_gradient_checkpointing=true"))
    assert len({w["node_id"] for w in result.workers}) == 2
    assert len(result.history) == 1 and math.isfinite(result.history[0]["actor/pg_loss"])
    step = result.history[0]  # the engines' counters over the step, both replicas: every model token, once
    assert step["engine/generated_tokens"] == step["rollout/model_tokens_total"] > 0
    assert step["engine/decode_steps"] > 0 and step["engine/prefill_tokens"] > 0 and step["engine/decode_s"] > 0


KILLER = '''
import os
CALLS = 0
def reward(data_source, solution_str, ground_truth, extra_info=None):
    global CALLS
    CALLS += 1
    if CALLS > 4:  # 2 calls per rank per step: this rank dies during step 3's rollout
        os._exit(1)
    return 0.0
'''


def test_dying_worker_stops_run_with_clear_error_and_intact_checkpoint(ray_cluster, make_cfg, dev_model_path, tmp_path):
    reward = tmp_path / "killer.py"
    reward.write_text(KILLER)
    run = tmp_path / "run"
    cfg = make_cfg(*FAST, f"actor_rollout_ref.model.path={dev_model_path}", f"data.reward_fn={reward}:reward",
                   "trainer.save_freq=1", "trainer.total_training_steps=4", run_dir=run)
    with pytest.raises(TrainingError) as err:
        train(cfg)
    msg = str(err.value)
    assert "step 3" in msg and "died" in msg and "global_step_2" in msg
    latest = ckpt.latest_checkpoint(run)
    assert latest.name == "global_step_2"
    assert json.loads((latest / "driver_state.json").read_text())["step"] == 2
    assert not list((run / "checkpoints").glob("*.tmp"))


def test_ppo_with_critic_completes(ray_cluster, make_cfg, dev_model_path, tmp_path, monkeypatch):
    """Also: trainer.profile_steps=[2] writes each rank's torch.profiler table and trace for step 2 only, and the
    run logs to MLflow (a file store in tmp_path) and W&B (offline): every step's metrics and trajectories."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    for var, value in [("WANDB_MODE", "offline"), ("WANDB_SILENT", "true"), ("WANDB_DATA_DIR", str(tmp_path / "wb")),
                       ("WANDB_CACHE_DIR", str(tmp_path / "wb")), ("WANDB_CONFIG_DIR", str(tmp_path / "wb"))]:
        monkeypatch.setenv(var, value)
    result = train(make_cfg(*FAST, f"actor_rollout_ref.model.path={dev_model_path}", "algorithm.adv_estimator=gae",
                            "algorithm.lam=0.95", "critic.optim.lr=1e-3", "trainer.total_training_steps=2",
                            "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.optim.lr_warmup_steps=2",
                            "trainer.profile_steps=[2]", "trainer.logger=[console,mlflow,wandb]",
                            "trainer.experiment_name=ppo", run_dir=tmp_path / "run"))
    client = MlflowClient((tmp_path / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("verl_agent").experiment_id])
    assert run.info.run_name == "ppo" and run.data.params["algorithm.adv_estimator"] == "gae"
    vf_loss = client.get_metric_history(run.info.run_id, "critic/vf_loss")
    assert [(m.step, m.value) for m in vf_loss] == [(s, pytest.approx(result.history[s - 1]["critic/vf_loss"]))
                                                    for s in (1, 2)]  # fmt: skip
    arts = [a.path for a in client.list_artifacts(run.info.run_id, "trajectories")]
    assert sorted(arts) == ["trajectories/step_1.jsonl", "trajectories/step_2.jsonl"]
    (wandb_run,) = (tmp_path / "run" / "wandb").glob("offline-run-*")
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(wandb_run)],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    history = [json.loads(line)["history"]["item"] for line in out.splitlines() if '"type":"history"' in line]
    assert [h["_step"] for h in history] == [1, 2]
    assert history[1]["actor/pg_loss"] == pytest.approx(result.history[1]["actor/pg_loss"])
    table = json.loads((wandb_run / "files" / history[0]["trajectories.path"]).read_text())
    uids = {json.loads(line)["uid"] for line in (tmp_path / "run" / "trajectories" / "step_1.jsonl").open()}
    assert table["data"] and {row[2] for row in table["data"]} <= uids  # rows of this run's step 1
    profiles = sorted(p.name for p in (tmp_path / "run" / "profile").iterdir())
    assert profiles == ["step_2_rank0.json.gz", "step_2_rank0.txt", "step_2_rank1.json.gz", "step_2_rank1.txt"]
    table = (tmp_path / "run" / "profile" / "step_2_rank0.txt").read_text()
    assert "aten::mm" in table and "Self CPU" in table  # the update's matmuls are among the top ops
    assert len(result.history) == 2
    assert result.history[0]["actor/lr"] == pytest.approx(0.5 * result.history[1]["actor/lr"])  # linear warmup
    for m in result.history:
        assert math.isfinite(m["critic/vf_loss"]) and math.isfinite(m["actor/pg_loss"]) and "actor/kl" in m
    assert result.export_dir is not None and (result.export_dir / "config.json").is_file()


ZERO = '''
def reward(data_source, solution_str, ground_truth, extra_info=None):
    return 0.0
'''


def test_uniform_groups_under_filter_groups_skip_the_update_and_the_run_goes_on(ray_cluster, make_cfg, dev_model_path,
                                                                               tmp_path):
    """DAPO filtering drops every group when all rewards are equal: no update, but the engine is woken again."""
    (tmp_path / "zero.py").write_text(ZERO)
    result = train(make_cfg(*FAST, f"actor_rollout_ref.model.path={dev_model_path}", "trainer.total_training_steps=2",
                            f"data.reward_fn={tmp_path / 'zero.py'}:reward", "algorithm.filter_groups.enable=true"))
    assert [m["train/kept_group_fraction"] for m in result.history] == [0.0, 0.0]
    assert all("actor/pg_loss" not in m and m["rollout/num_trajectories"] == 4 for m in result.history)
