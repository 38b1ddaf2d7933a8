"""Train higher/lower with each estimator and seed, one run after another, then draw the plot.

    python examples/turn_credit/run_all.py                   # 3 estimators x 3 seeds, then turn_credit.png
    python examples/turn_credit/run_all.py --plot-only       # redraw from results.json

Each run is `verl-agent train examples/turn_credit/config.yaml` with the warm-started model
(warm_start.py), `algorithm.adv_estimator=E` and `trainer.seed=S data.seed=S`; the evaluation success
rate (val/success_rate, every trainer.test_freq steps) of every run goes to results.json, and the plot
shows the mean over seeds with the min-max spread against the training trajectories seen.
Runs are sequential (one Ray instance, one CPU worker) to leave the machine's other cores alone.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
ESTIMATORS = ("grpo", "grpo_turn", "gigpo")
COLORS = {"grpo": "tab:gray", "grpo_turn": "tab:blue", "gigpo": "tab:orange", "gae_turn": "tab:green"}
# name in the plot -> overrides (gae over turns needs the critic: adv_estimator=gae + gae_timestep_unit=turn)
VARIANTS = {"grpo": ["algorithm.adv_estimator=grpo"], "grpo_turn": ["algorithm.adv_estimator=grpo_turn"],
            "gigpo": ["algorithm.adv_estimator=gigpo"],
            "gae_turn": ["algorithm.adv_estimator=gae", "algorithm.gae_timestep_unit=turn", "algorithm.lam=0.95",
                         "critic.optim.lr=1.0e-3"]}


def config_for(name: str, seed: int, model: Path, run_dir: Path, extra: list[str]):
    from verl_agent.config import load_config

    rel = lambda p: str(REPO / p)  # noqa: E731  (the config's paths are relative to the repository root)
    return load_config(HERE / "config.yaml", [
        f"data.train_files=[{rel('examples/turn_credit/data/train.jsonl')}]",
        f"data.val_files=[{rel('examples/turn_credit/data/test.jsonl')}]",
        f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={rel('examples/turn_credit/interaction.yaml')}",
        f"actor_rollout_ref.model.path={model}", f"trainer.seed={seed}", f"data.seed={seed}",
        f"trainer.default_local_dir={run_dir}", f"trainer.experiment_name={name}_seed{seed}",
        *VARIANTS[name], *extra])


def run_all(names: list[str], seeds: list[int], out: Path, runs: Path, extra: list[str]) -> dict:
    sys.path.insert(0, str(HERE))
    from warm_start import warm_start

    from verl_agent.trainer.sweep import run_sweep

    model = warm_start()
    return run_sweep(names, seeds, lambda name, seed, run_dir: config_for(name, seed, model, run_dir, extra), out, runs,
                     per_sample=True)


def plot(results: dict, path: Path, title: str) -> None:
    from verl_agent.trainer.sweep import plot_seeds

    plot_seeds(results, path, title, xlabel="training trajectories (samples)", ylabel="evaluation success (%)",
               colors=COLORS)


def summary(results: dict) -> str:
    lines = []
    for name, runs in results.items():
        finals = [r["curve"][-1][1] * 100 for r in runs.values()]
        lines.append(f"{name:10s} final evaluation success {sum(finals) / len(finals):5.1f} % "
                     f"(seeds: {', '.join(f'{f:.1f}' for f in finals)}; spread {max(finals) - min(finals):.1f})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--estimators", nargs="+", default=list(ESTIMATORS), choices=sorted(VARIANTS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--results", type=Path, default=HERE / "results.json")
    ap.add_argument("--plot", type=Path, default=HERE / "turn_credit.png")
    ap.add_argument("--runs", type=Path, default=REPO / "runs" / "turn_credit")
    ap.add_argument("--plot-only", action="store_true")
    ap.add_argument("--title", default="higher/lower, 4 rounds of 1..7, random training secrets, tiny model:\n"
                    "196 evaluation matches (49 fixed x 4 samples); mean of seeds, shaded min-max")
    ap.add_argument("overrides", nargs="*", help="extra config overrides, e.g. trainer.total_training_steps=2")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    if args.plot_only:
        results = json.loads(args.results.read_text())
    else:
        results = run_all(args.estimators, args.seeds, args.results, args.runs, args.overrides)
    plot(results, args.plot, args.title)
    print(summary(results))


if __name__ == "__main__":
    main()
