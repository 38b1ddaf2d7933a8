"""Seed sweeps for the examples' comparisons: train each variant with each seed, one run after another, keep every
run's held-out curve in a results file, and plot the mean over seeds with the min-max spread.

    results = run_sweep(["grpo", "gigpo"], [0, 1], config_for, Path("results.json"), Path("runs"))
    plot_seeds(results, Path("plot.png"), "title", xlabel="training step", ylabel="held-out success (%)")

`config_for(variant, seed, run_dir)` gives the run's config. The results file maps variant -> seed ->
``{"curve": [[x, success], ...], "seconds": s}`` (and, for each metric named in `keep`, ``"series": {key:
[[step, value], ...]}`` from the lines that log it) and is rewritten after every run, so a stopped sweep keeps
what finished, and a rerun skips the (variant, seed) pairs it already holds. Runs are sequential in one Ray
instance, to leave the machine's other cores alone.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from verl_agent.config import RunConfig

__all__ = ["metric_series", "plot_seeds", "run_sweep", "val_curve"]

Results = dict[str, dict[str, dict[str, Any]]]


def metric_series(run_dir: Path, key: str, samples_per_step: int = 1) -> list[tuple[int, float]]:
    """(step x samples_per_step, value) of every line of a run's metrics.jsonl that logs `key` (a step logged
    twice, as after a resume, counts once: its last line)."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        if key in m:
            out[int(m["step"]) * samples_per_step] = float(m[key])
    return sorted(out.items())


def val_curve(run_dir: Path, samples_per_step: int = 1) -> list[tuple[int, float]]:
    """(step x samples_per_step, val/success_rate) of each evaluation in a run's metrics.jsonl."""
    return metric_series(run_dir, "val/success_rate", samples_per_step)


def run_sweep(variants: list[str], seeds: list[int], config_for: Callable[[str, int, Path], RunConfig],
              results_path: Path, runs: Path, per_sample: bool = False, keep: tuple[str, ...] = ()
              ) -> Results:  # fmt: skip
    """Train every (variant, seed) not yet in `results_path`, seed by seed (a stopped sweep still has every
    variant's first seeds); the curve's x is the step, or the training trajectories seen with `per_sample`;
    `keep`: metrics kept as series by step (e.g. val/context/rewrites)."""
    from verl_agent.trainer.workers.controller import init_ray
    from verl_agent.trainer.loop import train

    results: Results = json.loads(results_path.read_text()) if results_path.exists() else {}
    # done in an earlier sweep: skipped (delete the results file to redo)
    todo = [(name, seed) for seed in seeds for name in variants if str(seed) not in results.get(name, {})]
    if not todo:
        return results
    started = init_ray(None)
    try:
        for name, seed in todo:
            run_dir = runs / f"{name}_seed{seed}"
            cfg = config_for(name, seed, run_dir)
            t0 = time.perf_counter()
            train(cfg)
            per_step = cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n if per_sample else 1
            run: dict[str, Any] = {"curve": val_curve(run_dir, per_step), "seconds": round(time.perf_counter() - t0, 1)}
            if keep:
                run["series"] = {key: metric_series(run_dir, key) for key in keep}
            results.setdefault(name, {})[str(seed)] = run
            results_path.write_text(json.dumps(results, indent=1))
    finally:
        if started:
            import ray

            ray.shutdown()
    return results


def plot_seeds(results: Results, path: Path, title: str, *, xlabel: str, ylabel: str,
               colors: dict[str, str] | None = None, ylim: tuple[float, float] | None = None,
               size: tuple[float, float] = (6.4, 4.2), dpi: int = 110, legend: str = "lower right",
               font: float = 10, legend_font: float | None = None) -> None:  # fmt: skip
    """Each variant's mean curve over its seeds (in %, at the x every seed has) with the min-max band."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("the plot needs matplotlib: pip install -e '.[plots]' (the results file is written)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=size)
    for name, by_seed in results.items():
        curves = [dict(map(tuple, r["curve"])) for r in by_seed.values()]
        xs = sorted(set.intersection(*(set(c) for c in curves)))
        ys = np.array([[c[x] for x in xs] for c in curves]) * 100
        color = (colors or {}).get(name)
        ax.plot(xs, ys.mean(0), marker="o", color=color, label=f"{name} (mean of {len(curves)} seeds)")
        ax.fill_between(xs, ys.min(0), ys.max(0), color=color, alpha=0.2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if ylim is not None:
        ax.set_ylim(*ylim)
    ax.set_title(title, fontsize=font)
    ax.grid(alpha=0.3)
    ax.legend(loc=legend, fontsize=legend_font)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
