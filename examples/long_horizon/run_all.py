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
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
STRATEGIES = ("none", "drop_observations", "truncate_middle", "summarize")
# kept by step in results.json beside the success curve: the reward and how often each strategy rewrote the history
KEEP = ("val/reward/mean", "val/context/rewrites", "val/context/rewrites_skipped", "rollout/context/rewrites",
        "rollout/context/rewrites_skipped")
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


def run_all(strategies: list[str], seeds: list[int], out: Path, runs: Path, extra: list[str]) -> dict:
    sys.path.insert(0, str(HERE))
    from warm_start import warm_start

    from verl_agent.trainer.sweep import run_sweep

    model = warm_start()
    return run_sweep(strategies, seeds, lambda name, seed, run_dir: config_for(name, seed, model, run_dir, extra),
                     out, runs, keep=KEEP)


def plot(results: dict, path: Path, title: str) -> None:
    from verl_agent.trainer.sweep import plot_seeds

    plot_seeds(results, path, title, xlabel="training step", ylabel="held-out success (%)", colors=COLORS,
               ylim=(-5, 105), size=(5.6, 3.6), dpi=80, legend="center right", font=9, legend_font=8)


def _last(run: dict, key: str) -> float | None:
    points = run.get("series", {}).get(key)
    return points[-1][1] if points else None


def _total(run: dict, key: str) -> float | None:
    points = run.get("series", {}).get(key)
    return sum(v for _, v in points) if points else None


def summary(results: dict) -> str:
    """Per strategy, means over seeds: held-out success first -> last evaluation, the last evaluation's reward and
    rewrites (skipped ones too), and the rewrites over all training steps."""
    def mean(values: list, digits: int = 1) -> str:
        values = [v for v in values if v is not None]
        return f"{sum(values) / len(values):.{digits}f}" if values else "-"

    lines = []
    for name, runs in results.items():
        finals = [r["curve"][-1][1] * 100 for r in runs.values()]
        firsts = [r["curve"][0][1] * 100 for r in runs.values()]
        lines.append(f"{name:18s} held-out success {sum(firsts) / len(firsts):5.1f} % -> {sum(finals) / len(finals):5.1f} %"
                     f" (seeds {', '.join(runs)}: {', '.join(f'{f:.1f}' for f in finals)}); last evaluation: reward "
                     f"{mean([_last(r, 'val/reward/mean') for r in runs.values()], 3)}, rewrites "
                     f"{mean([_last(r, 'val/context/rewrites') for r in runs.values()])} (skipped "
                     f"{mean([_last(r, 'val/context/rewrites_skipped') for r in runs.values()])}); training rewrites "
                     f"{mean([_total(r, 'rollout/context/rewrites') for r in runs.values()])}")
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
