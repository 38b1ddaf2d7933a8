"""Train the corridor with each context strategy and seed, one run after another, then draw the plot.

    python examples/long_horizon/run_all.py                  # every strategy x seeds 0, 1
    python examples/long_horizon/run_all.py --plot-only      # redraw from results.json

Each run is `verl-agent train examples/long_horizon/config.yaml` with the warm-started model
(warm_start.py), `actor_rollout_ref.rollout.multi_turn.context.strategy=S` and `trainer.seed=K data.seed=K`;
everything else (max_context_length, steps, batch) is the same. The held-out success rate
(val/success_rate, per episode, every trainer.test_freq steps) of every run goes to results.json.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
STRATEGIES = ("none", "drop_observations", "truncate_middle", "summarize")
COLORS = {"none": "tab:gray", "drop_observations": "tab:blue", "truncate_middle": "tab:green",
          "summarize": "tab:orange"}


def config_for(strategy: str, seed: int, model: Path, run_dir: Path, extra: list[str]):
    from verl_agent.config import load_config

    rel = lambda p: str(REPO / p)  # noqa: E731  (the config's paths are relative to the repository root)
    return load_config(HERE / "config.yaml", [
        f"data.train_files=[{rel('examples/long_horizon/data/train.jsonl')}]",
        f"data.val_files=[{rel('examples/long_horizon/data/test.jsonl')}]",
        f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={rel('examples/long_horizon/interaction.yaml')}",
        f"actor_rollout_ref.model.path={model}", f"trainer.seed={seed}", f"data.seed={seed}",
        f"trainer.default_local_dir={run_dir}", f"trainer.experiment_name={strategy}_seed{seed}",
        f"actor_rollout_ref.rollout.multi_turn.context.strategy={strategy}", *extra])


def held_out_curve(run_dir: Path) -> list[tuple[int, float]]:
    """(training step, held-out success) from a run's metrics.jsonl."""
    out = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        m = json.loads(line)
        if "val/success_rate" in m:
            out[int(m["step"])] = float(m["val/success_rate"])
    return sorted(out.items())


def run_all(strategies: list[str], seeds: list[int], out: Path, runs: Path, extra: list[str]) -> dict:
    sys.path.insert(0, str(HERE))
    from warm_start import warm_start

    from verl_agent.trainer.controller import init_ray
    from verl_agent.trainer.loop import train

    model = warm_start()
    results = json.loads(out.read_text()) if out.exists() else {}
    started = init_ray(None)
    try:
        for seed in seeds:
            for strategy in strategies:
                if str(seed) in results.get(strategy, {}):
                    continue  # done in an earlier sweep (delete results.json to redo)
                run_dir = runs / f"{strategy}_seed{seed}"
                t0 = time.perf_counter()
                train(config_for(strategy, seed, model, run_dir, extra))
                results.setdefault(strategy, {})[str(seed)] = {
                    "curve": held_out_curve(run_dir), "seconds": round(time.perf_counter() - t0, 1)}
                out.write_text(json.dumps(results, indent=1))  # after every run: a stopped sweep keeps its runs
    finally:
        if started:
            import ray

            ray.shutdown()
    return results


def plot(results: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(5.6, 3.6))
    for name, runs in results.items():
        curves = [dict(map(tuple, r["curve"])) for r in runs.values()]
        xs = sorted(set.intersection(*(set(c) for c in curves)))
        ys = np.array([[c[x] for x in xs] for c in curves]) * 100
        color = COLORS.get(name)
        ax.plot(xs, ys.mean(0), marker="o", color=color, label=f"{name} (mean of {len(curves)} seeds)")
        ax.fill_between(xs, ys.min(0), ys.max(0), color=color, alpha=0.2)
    ax.set_xlabel("training step")
    ax.set_ylabel("held-out success (%)")
    ax.set_ylim(-5, 105)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(loc="center right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def summary(results: dict) -> str:
    lines = []
    for name, runs in results.items():
        finals = [r["curve"][-1][1] * 100 for r in runs.values()]
        firsts = [r["curve"][0][1] * 100 for r in runs.values()]
        lines.append(f"{name:18s} held-out success {sum(firsts) / len(firsts):5.1f} % -> {sum(finals) / len(finals):5.1f} %"
                     f" (seeds {', '.join(runs)}: {', '.join(f'{f:.1f}' for f in finals)})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--strategies", nargs="+", default=list(STRATEGIES))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    ap.add_argument("--results", type=Path, default=HERE / "results.json")
    ap.add_argument("--plot", type=Path, default=HERE / "long_horizon.png")
    ap.add_argument("--runs", type=Path, default=REPO / "runs" / "long_horizon")
    ap.add_argument("--plot-only", action="store_true")
    ap.add_argument("--title", default="corridor, tiny model, max_context_length 448\n"
                    "held-out: 18 codes x 4 samples; shaded: min-max over seeds")
    ap.add_argument("overrides", nargs="*", help="extra config overrides, e.g. trainer.total_training_steps=2")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    results = json.loads(args.results.read_text()) if args.plot_only else run_all(
        args.strategies, args.seeds, args.results, args.runs, args.overrides)
    plot(results, args.plot, args.title)
    print(summary(results))


if __name__ == "__main__":
    main()
