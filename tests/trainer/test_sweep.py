"""trainer/sweep.py: the examples' seed sweeps (curves from metrics.jsonl, resumable results, the plot)."""

from __future__ import annotations

import json

import pytest

from verl_agent.trainer.sweep import metric_series, plot_seeds, run_sweep, val_curve


def test_val_curve_reads_evaluations_and_a_resumed_step_counts_once(tmp_path):
    lines = [{"step": 0, "val/success_rate": 0.25}, {"step": 1, "actor/pg_loss": 0.1},
             {"step": 2, "val/success_rate": 0.5}, {"step": 2, "val/success_rate": 0.75}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    assert val_curve(tmp_path) == [(0, 0.25), (2, 0.75)]
    assert val_curve(tmp_path, samples_per_step=8) == [(0, 0.25), (16, 0.75)]


def test_metric_series_keeps_any_metric_by_step(tmp_path):
    lines = [{"step": 0, "val/context/rewrites": 291.0}, {"step": 1, "rollout/context/rewrites": 40.0},
             {"step": 2, "rollout/context/rewrites": 44.0, "val/context/rewrites": 300.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    assert metric_series(tmp_path, "val/context/rewrites") == [(0, 291.0), (2, 300.0)]
    assert metric_series(tmp_path, "rollout/context/rewrites") == [(1, 40.0), (2, 44.0)]
    assert metric_series(tmp_path, "val/reward/mean") == []


def test_a_finished_sweep_is_not_run_again(tmp_path):
    done = {"a": {"0": {"curve": [[0, 0.5]], "seconds": 1.0}}}
    path = tmp_path / "results.json"
    path.write_text(json.dumps(done))

    def config_for(name, seed, run_dir):  # noqa: ANN001, ANN202
        raise AssertionError(f"{name} seed {seed} was trained again")

    assert run_sweep(["a"], [0], config_for, path, tmp_path / "runs") == done


def test_plot_seeds_draws_every_variant(tmp_path):
    pytest.importorskip("matplotlib")
    results = {"a": {"0": {"curve": [[0, 0.0], [1, 0.5]]}, "1": {"curve": [[0, 0.5], [1, 1.0]]}},
               "b": {"0": {"curve": [[0, 0.2], [1, 0.3]]}}}
    plot_seeds(results, tmp_path / "p.png", "t", xlabel="step", ylabel="success (%)", colors={"a": "tab:blue"})
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
