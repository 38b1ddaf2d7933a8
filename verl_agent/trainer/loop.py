"""`train(cfg)`: the whole RL loop, top to bottom, each phase in a named timing scope.

    rollout (n per prompt, on every rank's engine) -> old/ref log-probs (+ values)
    -> advantages (algorithm.adv_estimator) -> update (critic, actor) -> weight sync
    -> metrics -> checkpoint (trainer.save_freq) -> validation (trainer.test_freq)

The driver (this process) owns the loop; `WorkerGroup` holds the Ray workers.
Data stays on the worker that generated it: the driver sends prompts and settings
and gets back per-trajectory summaries and metrics (`perf/driver_bytes` per step).
Infrastructure failures never become reward: workers keep them out of the loss, the
metrics count them per cause, and a step whose share of them exceeds
trainer.max_infra_failure_fraction stops the run naming the cause and an example.
A worker that dies, a step that raises or a checkpoint that cannot be written
(full disk) stops the run with `TrainingError` naming the step, the cause and the
last complete checkpoint; rerunning the same command resumes from the newest
checkpoint that verifies (checkpoint.find_latest: a truncated one is skipped, with a
warning saying why) and recomputes the steps after it exactly (seeded per step).
Each checkpoint also holds its step's metrics line, so a driver killed between
writing a checkpoint and logging the step loses no line of metrics.jsonl.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verl_agent.config import RunConfig, save_config
from verl_agent.protocol import SCORED_OUTCOMES
from verl_agent.rollout.metrics import TrajectorySummary, summarize
from verl_agent.trainer.persistence import checkpoint as ckpt
from verl_agent.trainer.algorithms import make_kl_controller
from verl_agent.trainer.workers.controller import WorkerGroup, cpus_needed, init_ray
from verl_agent.trainer.errors import CheckpointWriteError, InfraFailureError, TrainingError
from verl_agent.trainer.feeder import Feeder, step_seed
from verl_agent.trainer.tracking.loggers import LoggerConfigError, check_loggers
from verl_agent.trainer.tracking.tracker import Tracker, timer
from verl_agent.trainer.workers.rollout_worker import RolloutResult

logger = logging.getLogger(__name__)

__all__ = ["TrainResult", "TrainingError", "train", "add_cli", "run_train_cli"]


@dataclass
class TrainResult:
    """What a finished run hands back: its steps' metrics, validation before and after, the exported policy."""

    run_dir: Path
    steps: int
    val_before: dict[str, float] = field(default_factory=dict)
    val_after: dict[str, float] = field(default_factory=dict)
    history: list[dict[str, float]] = field(default_factory=list)
    export_dir: Path | None = None
    resumed_from: int = 0
    workers: list[dict] = field(default_factory=list)  # per rank: node, node_id, device, pid


def train(cfg: RunConfig) -> TrainResult:
    """Run GRPO/PPO training as configured; see the module docstring."""
    run = TrainingRun(cfg)
    try:
        run.start()
        for step in run.steps():
            run.log_step(step, run.train_step(step))
        run.finish()
    except Exception as e:  # WorkerFailure (dead worker / raising step), too many infra failures, disk full, ...
        raise run.stopped(e) from e
    finally:
        run.close()
    _print_summary(run.result, run.tracker)
    return run.result


class TrainingRun:
    """The driver's side of one `train` call: the workers, the feeder, the KL controller, the metrics
    tracker, the step reached and the last complete checkpoint. `train` calls its steps in order."""

    def __init__(self, cfg: RunConfig) -> None:
        from verl_agent.rollout.build import load_split, train_dataset

        check_loggers(cfg.trainer.logger)  # a tracker that cannot open its run fails now, not after the workers
        self.dataset = train_dataset(cfg.data)
        self.cfg = cfg = _with_total_steps(cfg)
        self.total = cfg.trainer.total_training_steps
        save_config(cfg, cfg.run_dir / "config.yaml")
        self.val_samples = load_split(cfg.data, "val") if cfg.data.val_files else []
        self.n_minibatches = max(1, cfg.data.train_batch_size // cfg.actor_rollout_ref.actor.ppo_mini_batch_size)
        self.kl_ctrl = make_kl_controller(cfg.algorithm.kl_ctrl)
        self.started_ray = init_ray(cfg.trainer.ray_address, min_cpus=cpus_needed(cfg))
        self.group: WorkerGroup | None = None
        self.tracker: Tracker | None = None
        self.last_ckpt: Path | None = None
        self.step = 0
        self.result = TrainResult(run_dir=cfg.run_dir, steps=self.total)

    def start(self) -> None:
        """Place the workers, resume from the newest checkpoint if there is one, open the metrics, validate
        before training (trainer.val_before_train) and set up the feeder."""
        cfg = self.cfg
        self.last_ckpt = _resume_point(cfg)
        self.group = group = WorkerGroup.create(cfg)
        self.result.workers = group.info
        state = _resume(group, self.dataset, self.last_ckpt) if self.last_ckpt is not None else {}
        if state:
            self.step = self.result.resumed_from = state["step"]
            self.result.val_before = state.get("val_before", {})
            self.kl_ctrl.load_state_dict(state.get("kl_ctrl", self.kl_ctrl.state_dict()))
        self.tracker = Tracker(cfg.run_dir, cfg.trainer.logger, append=self.step > 0, config=cfg.model_dump(),
                               project=cfg.trainer.project_name, experiment=cfg.trainer.experiment_name)
        self.tracker.truncate_after(self.step)
        _restore_metrics_line(self.tracker, self.step, state.get("metrics"))
        _truncate_trajectory_logs(cfg.run_dir, self.step)
        if self.step == 0 and cfg.trainer.val_before_train and self.val_samples:
            self.result.val_before = _validate(group, self.val_samples, cfg, 0)
            self.tracker.log(0, self.result.val_before, write=print)
            self.tracker.log_trajectories(0, _trajectory_files(cfg.run_dir, 0))
        self.feeder = Feeder(group, self.dataset.batches(1), cfg, self.total, first=self.step + 1,
                             replay=state.get("in_flight", []))

    def steps(self) -> Iterator[int]:
        """The steps left to train, with a progress bar."""
        from tqdm import tqdm

        self.bar = tqdm(range(self.step + 1, self.total + 1), desc="train", unit="step", file=sys.stderr,
                        dynamic_ncols=True)
        for step in self.bar:
            self.step = step
            yield step

    def train_step(self, step: int) -> dict[str, Any]:
        """One step, each phase timed: rollout, learning (log-probs, advantages, update, weight sync), then
        the checkpoint and the validation when they are due. Returns the step's metrics."""
        group, trainer_cfg = self.group, self.cfg.trainer
        metrics: dict[str, Any] = {}
        bytes_before = group.bytes_moved
        profiling = step in (trainer_cfg.profile_steps or [])
        with group.profile(str(self.cfg.run_dir / "profile"), step) if profiling else nullcontext([]) as tables:
            with timer("step", metrics):
                self._rollout(step, metrics)
                self._learn(step, metrics)
        if profiling:
            logger.info("step %d profile: %s", step, ", ".join(tables))
        metrics.setdefault("actor/kl", metrics.get("actor/ppo_kl", 0.0))
        metrics["perf/driver_bytes"] = float(group.bytes_moved - bytes_before)
        if (trainer_cfg.save_freq > 0 and step % trainer_cfg.save_freq == 0) or step == self.total:
            with timer("checkpoint", metrics):
                self._checkpoint(step, metrics)
        if trainer_cfg.test_freq > 0 and step % trainer_cfg.test_freq == 0 and step != self.total and self.val_samples:
            metrics.update(_validate(group, self.val_samples, self.cfg, step))
        return metrics

    def _rollout(self, step: int, metrics: dict[str, Any]) -> None:
        """This step's groups (fed ahead as trainer.mode asks) and their rollout metrics; stops the step when
        infrastructure failures exceed trainer.max_infra_failure_fraction."""
        with timer("rollout", metrics):
            self.feeder.fill(step)  # sync: this step's batch; one_step_off / async: also the next ones
            outs = self.feeder.take(step, min_version=step - 1 - self.feeder.staleness)
            summaries = [summary for out in outs for summary in out.summaries]
            metrics.update(_rollout_metrics(outs, summaries, step))
            _check_infra_failures(summaries, self.cfg.trainer.max_infra_failure_fraction)

    def _learn(self, step: int, metrics: dict[str, Any]) -> None:
        """Log-probs, advantages (and the KL controller), the update, and the weight sync to the engines."""
        group = self.group
        with timer("log_probs", metrics):
            metrics.update(group.compute_log_probs(self.n_minibatches))
        with timer("advantages", metrics):
            advantages = group.compute_advantages(self.kl_ctrl.value)
            metrics.update(advantages.metrics)
            self.kl_ctrl.update(advantages.kl, advantages.sequences)
        if advantages.sequences == 0:  # e.g. every group uniform under filter_groups: nothing to learn from
            logger.warning("step %d: no sequence left to train on; skipping the update", step)
        else:
            with timer("update", metrics):
                per_rank = group.update(self.n_minibatches, step, step > self.cfg.trainer.critic_warmup)
                metrics.update(_mean_over_ranks(per_rank, prefix="actor/"))
        with timer("weight_sync", metrics):  # also after a skipped update: it wakes the engine and bumps the version
            metrics["time/weight_sync_worker"] = group.sync_weights(version=step)
            metrics["perf/weight_sync_bytes"] = float(group.sync_bytes)

    def _checkpoint(self, step: int, metrics: dict[str, Any]) -> None:
        driver = {"val_before": self.result.val_before, "kl_ctrl": self.kl_ctrl.state_dict(),
                  "in_flight": self.feeder.in_flight(),
                  "metrics": {key: value for key, value in metrics.items() if isinstance(value, (int, float))}}
        self.last_ckpt = _save(self.group, self.cfg.run_dir, step, self.dataset, driver)

    def log_step(self, step: int, metrics: dict[str, Any]) -> None:
        """The step's metrics line (JSONL, TensorBoard, console) and its place in the result's history."""
        self.tracker.log(step, metrics, write=self.bar.write)
        self.tracker.log_trajectories(step, _trajectory_files(self.cfg.run_dir, step))
        self.result.history.append(metrics)

    def finish(self) -> None:
        """Validation after training and the final policy in Hugging Face format."""
        if self.val_samples:
            self.result.val_after = _validate(self.group, self.val_samples, self.cfg, self.total)
            self.tracker.log(self.total, self.result.val_after, write=print)
            self.tracker.log_trajectories(self.total, _trajectory_files(self.cfg.run_dir, self.total)[1:])
        self.result.export_dir = Path(self.group.checkpoints.export_hf(str(self.cfg.run_dir / "hf_model")))

    def stopped(self, error: Exception) -> TrainingError:
        """Kill the workers after `error`; the `TrainingError` naming the step, the cause and the checkpoint."""
        if self.group is not None:
            self.group.shutdown(graceful=False)
            self.group = None
        return TrainingError(f"training stopped at step {self.step}: {error}\n"
                             + resume_hint(self.last_ckpt, self.cfg.trainer.resume_mode))

    def close(self) -> None:
        """Stop the workers, close the metrics, and stop Ray if this run started it."""
        if self.group is not None:
            self.group.shutdown()
        if self.tracker is not None:
            self.tracker.close()
        if self.started_ray:
            import ray

            ray.shutdown()


def resume_hint(last_ckpt: Path | None, resume_mode: str) -> str:
    """What a rerun would do after a stop: resume only where a complete checkpoint exists, and only say
    "rerun the same command" where that command resumes from it (trainer.resume_mode=auto)."""
    if last_ckpt is None:
        return "no checkpoint was written yet: a rerun starts again from step 0"
    if resume_mode == "auto":
        return f"last complete checkpoint: {last_ckpt}; rerun the same command to resume from it"
    return (f"last complete checkpoint: {last_ckpt}; to resume from it, rerun with trainer.resume_mode=resume_path "
            f"trainer.resume_from_path={last_ckpt} (trainer.resume_mode is {resume_mode})")


def _rollout_metrics(outs: list[RolloutResult], summaries: list[TrajectorySummary], step: int) -> dict[str, float]:
    """A step's rollout metrics: reward/tool time (slowest shard), trajectory statistics, policy lag, what
    the failure rules left out and the engines' counters (summed over shards)."""
    metrics = {"time/reward": max(out.reward_seconds for out in outs),
               "time/tools": max(out.tool_seconds for out in outs), **summarize(summaries)}
    # the engines hold version step-1; only what the loss sees has a lag that matters
    lags = [step - 1 - summary.oldest_version for summary in summaries if summary.outcome in SCORED_OUTCOMES]
    metrics["rollout/policy_lag/mean"] = sum(lags) / max(1, len(lags))
    metrics["rollout/policy_lag/max"] = float(max(lags, default=0))
    for attr in ("counts", "engine"):  # failure-rule counts; engine counters of this step, all replicas
        keys = set().union(*(getattr(out, attr) for out in outs))
        metrics.update({key: sum(getattr(out, attr).get(key, 0.0) for out in outs) for key in keys})
    return metrics


def _check_infra_failures(summaries: list, max_fraction: float) -> None:
    """Stop the step when infrastructure failures exceed their allowed share; name the main cause and an example."""
    failed = [summary for summary in summaries if summary.outcome == "infra_failure"]
    if not summaries or len(failed) / len(summaries) <= max_fraction:
        return
    causes = Counter(summary.cause for summary in failed)
    cause, _ = causes.most_common(1)[0]
    example = next(summary for summary in failed if summary.cause == cause)
    raise InfraFailureError(
        f"{len(failed)} of {len(summaries)} trajectories failed for infrastructure reasons "
        f"(> trainer.max_infra_failure_fraction={max_fraction}); causes: {dict(causes)}. "
        f"Example ({cause}, prompt {example.uid}): {example.error}"
    )


# -- helpers (small, called from train) ------------------------------------------------------------


def _with_total_steps(cfg: RunConfig) -> RunConfig:
    """Resolve trainer.total_training_steps from total_epochs x batches per epoch when unset."""
    if cfg.trainer.total_training_steps:
        return cfg
    from verl_agent.data import iter_samples

    rows = sum(1 for path in cfg.data.train_files
               for _ in iter_samples(path, prompt_key=cfg.data.prompt_key, skip_bad_rows=cfg.data.skip_bad_rows))
    cfg = cfg.model_copy(deep=True)
    cfg.trainer.total_training_steps = max(1, cfg.trainer.total_epochs * (rows // cfg.data.train_batch_size))
    return cfg


def _mean_over_ranks(per_rank: list[dict[str, float]], prefix: str) -> dict[str, float]:
    """Each metric's mean over the ranks that report it; a bare name gets `prefix` (critic/ for the critic's)."""
    keys = set().union(*per_rank) if per_rank else set()
    out = {}
    for key in keys:
        values = [rank_metrics[key] for rank_metrics in per_rank if key in rank_metrics]
        name = key if "/" in key else (("critic/" if key.startswith(("vf_", "critic_")) else prefix) + key)
        out[name] = sum(values) / len(values)
    return out


def _validate(group: WorkerGroup, samples: list, cfg: RunConfig, step: int) -> dict[str, float]:
    """Held-out rollouts with rollout.val_kwargs (greedy by default); metrics under val/."""
    from verl_agent.rollout.build import sampling_params

    rollout_cfg = cfg.actor_rollout_ref.rollout
    sampling = sampling_params(rollout_cfg, cfg.data, seed=step_seed(cfg.trainer.seed, -1), validate=True)
    started = time.perf_counter()
    outs = group.validate(samples, rollout_cfg.val_kwargs.n, sampling, step)
    metrics = summarize([summary for out in outs for summary in out.summaries])
    val = {key.replace("rollout/", "val/", 1): value for key, value in metrics.items()}
    val["time/validation"] = time.perf_counter() - started
    return val


def _trajectory_files(run_dir: Path, step: int) -> list[Path]:
    """The trajectory logs of `step` (trainer.log_trajectories): its training rollouts and its validation."""
    return [run_dir / "trajectories" / f"{prefix}step_{step}.jsonl" for prefix in ("", "val_")]


def _truncate_trajectory_logs(run_dir: Path, step: int) -> None:
    """On resume: drop trajectory logs of steps after the checkpoint (they are rolled out again)."""
    for path in (run_dir / "trajectories").glob("*step_*.jsonl"):
        if int(path.stem.rsplit("_", 1)[1]) > step:
            path.unlink()


def _resume_point(cfg: RunConfig) -> Path | None:
    """The checkpoint to resume from: trainer.resume_from_path (verified), or the newest complete one (auto)."""
    trainer_cfg = cfg.trainer
    if trainer_cfg.resume_mode == "disable":
        return None
    if trainer_cfg.resume_mode == "resume_path":
        path = trainer_cfg.resume_from_path
        problem = ckpt.verify(Path(path)) if path else "it is not set"
        if problem:
            raise TrainingError(f"trainer.resume_from_path={path!r} is not a complete checkpoint: {problem}")
        return Path(path)
    path, skipped = ckpt.find_latest(cfg.run_dir)
    instead = f"resuming from {path} instead" if path else "no complete checkpoint is left: starting from step 0"
    for line in skipped:
        logger.warning("%s; %s", line, instead)
    return path


def _restore_metrics_line(tracker: Tracker, step: int, saved: dict[str, float] | None) -> None:
    """Write the resumed step's metrics line from its checkpoint when the driver died before logging it."""
    if not saved or not tracker.path.exists():
        return
    if not any(json.loads(line).get("step") == step for line in tracker.path.read_text().splitlines() if line):
        tracker.log(step, saved, write=logger.info)


def _resume(group: WorkerGroup, dataset: Any, path: Path) -> dict:
    """Load the checkpoint at `path` into the workers, the data position and the driver's RNG; its driver state."""
    state = json.loads((path / "driver_state.json").read_text())
    group.checkpoints.load(str(path), state["step"])
    dataset.load_state_dict(state["data"])
    ckpt.restore_driver_rng(state)
    logger.info("resumed from %s (step %d)", path, state["step"])
    return state


def _save(group: WorkerGroup, run_dir: Path, step: int, dataset: Any, extra: dict) -> Path:
    """Write the checkpoint of `step` (workers' shards, then the driver state) and put it in place; its path."""
    tmp = ckpt.tmp_dir(run_dir, step)
    try:
        group.checkpoints.save(str(tmp))
        return ckpt.finalize(tmp, ckpt.driver_state(step, dataset.state_dict(), extra))
    except Exception as e:
        ckpt.discard(tmp)
        raise CheckpointWriteError(f"writing checkpoint {tmp.name[: -len('.tmp')]} failed (the partial one was "
                                   f"removed): {e}") from e


def _print_summary(result: TrainResult, tracker: Tracker | None) -> None:
    """What changed on the held-out set, and where the metrics and the final policy are."""
    before, after = result.val_before, result.val_after
    if "val/success_rate" in before and "val/success_rate" in after:
        rate_before, rate_after = before["val/success_rate"], after["val/success_rate"]
        print(f"held-out success rate: before {rate_before:.1%} -> after {rate_after:.1%} "
              f"({(rate_after - rate_before) * 100:+.1f} points)")
    calls_before, calls_after = before.get("val/tool_calls_total"), after.get("val/tool_calls_total")
    n_before, n_after = before.get("val/num_trajectories"), after.get("val/num_trajectories")
    if calls_before is not None and calls_after is not None and n_before and n_after:  # what tool-use RL changes first
        print(f"held-out tool calls per problem: before {calls_before / n_before:.2f} -> after "
              f"{calls_after / n_after:.2f}")
    if tracker is not None:
        print(f"metrics: {tracker.path}" + (f"   tensorboard: {tracker.tb_dir}" if tracker.tb is not None else ""))
        for name, where in tracker.destinations.items():
            print(f"{name}: {where}")
    if result.export_dir:
        print(f"final policy (Hugging Face format): {result.export_dir}")


def add_cli(subparsers: Any) -> None:
    """`verl-agent train CONFIG [key=value ...]`."""
    p = subparsers.add_parser("train", help="train a policy with GRPO/PPO (Ray + FSDP2 + hybrid engine)")
    p.add_argument("config", help="run config YAML")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.train_batch_size=8")
    p.set_defaults(func=run_train_cli)


def run_train_cli(args: Any) -> int:
    from verl_agent.config import load_config

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        train(load_config(args.config, list(args.overrides)))
    except (TrainingError, LoggerConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
