"""trainer.logger=wandb / mlflow: the real libraries, offline, read back with their own readers.

W&B runs in offline mode (no network here) and is read back from its transaction log by the W&B
package's own reader (`wandb leet inspect --json`, the wandb-core binary). MLflow writes its default
file store (./mlruns) and is read back with `MlflowClient`. The tracker is driven directly with the
metrics and trajectory records a step produces (records written by `write_records`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from verl_agent.protocol import Message, RolloutBatch, Trajectory
from verl_agent.rollout.records import write_records
from verl_agent.trainer.tracking.loggers import TABLE_ROWS, flatten_params
from verl_agent.trainer.tracking.tracker import Tracker

STEP_METRICS = {1: {"rollout/reward/mean": 0.25, "actor/kl": 0.01, "rollout/infra_failed/tool_timeout": 2.0},
                2: {"rollout/reward/mean": 0.5, "actor/kl": 0.02, "rollout/infra_failed/tool_timeout": 0.0}}
CONFIG = {"trainer": {"project_name": "proj", "experiment_name": "exp", "logger": ["console", "wandb"]},
          "data": {"train_files": ["a.jsonl", "b.jsonl"], "reward_fn": "x" * 9000},
          "actor_rollout_ref": {"rollout": {"sglang": {"env": {"A:B": "1"}}}}}


@pytest.fixture
def offline_env(monkeypatch, tmp_path):
    """No API key, no ~/.netrc, no tracking URI: the defaults a fresh machine has."""
    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "MLFLOW_TRACKING_URI",
                "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.setenv(var, "")  # so that teardown restores what was there, also what the tracker sets
        monkeypatch.delenv(var)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))  # wandb's staging and settings, and no netrc
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _write_step(run_dir: Path, step: int, n: int) -> Path:
    trajs = [Trajectory(uid=f"s{step}-{i}", prompt_ids=[], response_ids=[], loss_mask=[], rollout_logprobs=[],
                        reward=float(i % 2), data_source="calculator", outcome="ok" if i % 2 else "policy_failure",
                        cause=None if i % 2 else "wrong_answer",
                        messages=[Message(role="user", content=f"What is {i} + {step}?"),
                                  Message(role="assistant", content=f"The answer is {i + step}.")])
             for i in range(n)]  # fmt: skip
    return write_records(run_dir / "trajectories" / f"step_{step}.jsonl", RolloutBatch(trajs), step=step)


def _drive(run_dir: Path, loggers: list[str], steps=(1, 2), append: bool = False) -> Tracker:
    tracker = Tracker(run_dir, loggers, append=append, config=CONFIG, project="proj", experiment="exp")
    for step in steps:
        path = _write_step(run_dir, step, n=20)
        tracker.log(step, STEP_METRICS[step], write=lambda line: None)
        tracker.log_trajectories(step, [path, run_dir / "trajectories" / f"val_step_{step}.jsonl"])
    tracker.close()
    return tracker


def test_wandb_offline_run_reads_back_metrics_config_and_trajectory_tables(offline_env):
    run_dir = offline_env / "run"
    tracker = _drive(run_dir, ["console", "wandb"])
    (run_path,) = (run_dir / "wandb").glob("offline-run-*")  # no API key: offline, no prompt
    assert tracker.destinations["wandb"].endswith(f"upload: wandb sync {run_path}")
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_path)],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    records = [json.loads(line) for line in out.splitlines() if line.strip()]
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    assert (run["project"], run["display_name"]) == ("proj", "exp")
    config = run["config"]["update"]
    assert config["trainer"]["project_name"] == "proj" and config["data"]["train_files"] == ["a.jsonl", "b.jsonl"]
    history = {r["history"]["item"]["_step"]: r["history"]["item"] for r in records if r["type"] == "history"}
    assert sorted(history) == [1, 2]
    for step, metrics in STEP_METRICS.items():
        for key, value in metrics.items():
            assert history[step][key] == pytest.approx(value)
        table_file = run_path / "files" / history[step]["trajectories.path"]
        table = json.loads(table_file.read_text())
        assert table["columns"][:3] == ["step", "file", "uid"]
        assert len(table["data"]) == TABLE_ROWS  # a sample of the 20 trajectories
        uids = {row[2] for row in table["data"]}
        assert len(uids) == TABLE_ROWS and all(u.startswith(f"s{step}-") for u in uids)
        row = table["data"][0]
        assert row[0] == step and row[1] == f"step_{step}.jsonl" and "The answer is" in row[-1]
        assert "val/trajectories.path" not in history[step]  # no validation file this step: no table


def test_mlflow_default_file_store_reads_back_with_mlflow_client(offline_env):
    from mlflow.tracking import MlflowClient

    run_dir = offline_env / "run"
    tracker = _drive(run_dir, ["mlflow"])
    store = offline_env / "mlruns"
    assert store.is_dir()  # ./mlruns under the current directory
    client = MlflowClient(tracking_uri=store.as_uri())
    exp = client.get_experiment_by_name("proj")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.run_name == "exp" and run.info.status == "FINISHED"
    for key in STEP_METRICS[1]:
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        assert history == [(s, pytest.approx(STEP_METRICS[s][key])) for s in (1, 2)]
    params = run.data.params
    assert params["trainer.project_name"] == "proj"
    assert json.loads(params["data.train_files"]) == ["a.jsonl", "b.jsonl"]
    assert 500 <= len(params["data.reward_fn"]) < 9000  # cut to MLflow's limit
    assert params["actor_rollout_ref.rollout.sglang.env.A_B"] == "1"  # a key MLflow refuses, made valid
    arts = sorted(a.path for a in client.list_artifacts(run.info.run_id, "trajectories"))
    assert arts == ["trajectories/step_1.jsonl", "trajectories/step_2.jsonl"]
    local = client.download_artifacts(run.info.run_id, "trajectories/step_2.jsonl", str(offline_env / "dl"))
    assert Path(local).read_text() == (run_dir / "trajectories" / "step_2.jsonl").read_text()
    assert tracker.path.exists() and len(tracker.path.read_text().splitlines()) == 2  # metrics.jsonl as always

    # a resumed run (same run dir) goes on in the same MLflow run
    _drive(run_dir, ["mlflow"], steps=(2,), append=True)
    assert [r.info.run_id for r in client.search_runs([exp.experiment_id])] == [run.info.run_id]


def test_missing_extra_is_named_with_its_pip_install(monkeypatch, tmp_path):
    from verl_agent.config import ConfigError, load_config

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"trainer\.logger.*pip install verl-agent\[wandb\]"):
        load_config(None, ["trainer.logger=[console,wandb]"])
    with pytest.raises(ImportError, match=r"pip install verl-agent\[wandb\]"):
        Tracker(tmp_path, ["wandb"])
    with pytest.raises(ConfigError, match="registered loggers: console, mlflow, tensorboard, wandb"):
        load_config(None, ["trainer.logger=[console,neptune]"])


def test_flatten_params_keys_and_limits():
    flat = flatten_params({"a": {"b": 1, "c": [1, 2], "d": {}}, "e": "xyz", "f": None}, max_value=2)
    assert flat == {"a.b": "1", "a.c": "[1", "a.d": "{}", "e": "xy", "f": "nu"}
    assert flatten_params({}, max_value=10) == {}


def test_a_failing_tracker_costs_a_warning_not_the_run(offline_env, caplog, monkeypatch):
    """The MLflow store disappears mid-run: the step is still in metrics.jsonl, the run goes on; a resume whose
    stored run id is not in the tracking store (here: another MLFLOW_TRACKING_URI) starts a new MLflow run."""
    import shutil

    from mlflow.tracking import MlflowClient

    run_dir = offline_env / "run"
    tracker = Tracker(run_dir, ["mlflow"], config=CONFIG, project="proj", experiment="exp")
    tracker.log(1, STEP_METRICS[1], write=lambda line: None)
    shutil.rmtree(offline_env / "mlruns")
    with caplog.at_level("WARNING"):
        tracker.log(2, STEP_METRICS[2], write=lambda line: None)
        tracker.log_trajectories(2, [_write_step(run_dir, 2, n=3)])
        tracker.close()
    warned = [r.getMessage() for r in caplog.records if r.name == "verl_agent.trainer.tracking.tracker"]
    assert len(warned) == 3 and "mlflow could not log metrics of step 2" in warned[0]
    assert [json.loads(line)["step"] for line in tracker.path.read_text().splitlines()] == [1, 2]
    old_id = json.loads((run_dir / "loggers.json").read_text())["mlflow"]
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (offline_env / "elsewhere").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # a file store the user names: their opt-in
    _drive(run_dir, ["mlflow"], steps=(2,), append=True)
    new_id = json.loads((run_dir / "loggers.json").read_text())["mlflow"]
    client = MlflowClient((offline_env / "elsewhere").as_uri())
    assert new_id != old_id and client.get_run(new_id).data.metrics["actor/kl"] == pytest.approx(0.02)


def test_a_tracker_that_cannot_open_its_run_fails_before_ray_with_the_fix(offline_env, monkeypatch):
    from verl_agent.config import load_config
    from verl_agent.trainer import loop
    from verl_agent.trainer.tracking.loggers import LoggerConfigError, check_loggers

    def no_ray(*args, **kwargs):
        raise AssertionError("Ray started before the loggers were checked")

    monkeypatch.setattr(loop, "init_ray", no_ray)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (offline_env / "mlruns").as_uri())  # MLflow 3 refuses it unless opted in
    cfg = load_config(None, ["trainer.logger=[console,mlflow]", f"trainer.default_local_dir={offline_env / 'run'}"])
    with pytest.raises(LoggerConfigError, match=r"MLFLOW_TRACKING_URI=file:.*set MLFLOW_ALLOW_FILE_STORE=true, or "
                                                r"use a database store, e\.g\. MLFLOW_TRACKING_URI=sqlite:///mlflow\.db"):
        loop.train(cfg)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "./mlruns")  # a plain path is the file store too
    with pytest.raises(LoggerConfigError, match="MLFLOW_ALLOW_FILE_STORE"):
        check_loggers(["mlflow"])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:///mlflow.db")
    check_loggers(["mlflow"])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "./mlruns")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    check_loggers(["mlflow"])
    monkeypatch.setenv("WANDB_MODE", "ofline")
    with pytest.raises(LoggerConfigError, match="WANDB_MODE='ofline' is not a W&B mode; use one of online, offline"):
        check_loggers(["console", "wandb"])
    check_loggers(["console"])  # W&B's settings are not its business when it is not named


def test_the_resume_hint_is_shown_only_where_resuming_helps(tmp_path):
    from verl_agent.trainer.loop import resume_hint

    ckpt = tmp_path / "global_step_4"
    assert resume_hint(None, "auto") == "no checkpoint was written yet: a rerun starts again from step 0"
    assert resume_hint(ckpt, "auto") == f"last complete checkpoint: {ckpt}; rerun the same command to resume from it"
    for mode in ("disable", "resume_path"):  # the same command would not resume from this checkpoint
        hint = resume_hint(ckpt, mode)
        assert "rerun the same command" not in hint
        assert f"trainer.resume_mode=resume_path trainer.resume_from_path={ckpt}" in hint
