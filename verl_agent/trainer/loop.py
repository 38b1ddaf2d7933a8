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
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verl_agent.config import RunConfig, save_config
from verl_agent.rollout.metrics import summarize
from verl_agent.trainer import checkpoint as ckpt
from verl_agent.trainer.algorithms import make_kl_controller
from verl_agent.trainer.controller import WorkerGroup, cpus_needed, init_ray
from verl_agent.trainer.tracking import Tracker, timer

logger = logging.getLogger(__name__)

__all__ = ["TrainResult", "TrainingError", "InfraFailureError", "train", "add_cli", "run_train_cli"]


class TrainingError(RuntimeError):
    """The run stopped; the message says at which step, why, and which checkpoint is intact."""


@dataclass
class TrainResult:
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
    from tqdm import tqdm

    from verl_agent.rollout.build import load_split, train_dataset

    t = cfg.trainer
    run_dir = cfg.run_dir
    dataset = train_dataset(cfg.data)
    cfg = _with_total_steps(cfg)
    total = cfg.trainer.total_training_steps
    save_config(cfg, run_dir / "config.yaml")
    val_samples = load_split(cfg.data, "val") if cfg.data.val_files else []
    n_mini = max(1, cfg.data.train_batch_size // cfg.actor_rollout_ref.actor.ppo_mini_batch_size)
    kl_ctrl = make_kl_controller(cfg.algorithm.kl_ctrl)
    started_ray = init_ray(t.ray_address, min_cpus=cpus_needed(cfg))
    group, tracker, step, last_ckpt = None, None, 0, None
    result = TrainResult(run_dir=run_dir, steps=total)
    try:
        last_ckpt = _resume_point(cfg)
        group = WorkerGroup.create(cfg)
        result.workers = group.info
        in_flight: list[dict] = []
        saved_metrics = None
        if last_ckpt is not None:
            state = _resume(group, dataset, last_ckpt)
            step = result.resumed_from = state["step"]
            result.val_before = state.get("val_before", {})
            kl_ctrl.load_state_dict(state.get("kl_ctrl", kl_ctrl.state_dict()))
            in_flight = state.get("in_flight", [])
            saved_metrics = state.get("metrics")
        tracker = Tracker(run_dir, t.logger, append=step > 0)
        tracker.truncate_after(step)
        _restore_metrics_line(tracker, step, saved_metrics)
        _truncate_trajectory_logs(run_dir, step)
        if step == 0 and t.val_before_train and val_samples:
            result.val_before = _validate(group, val_samples, cfg, 0)
            tracker.log(0, result.val_before, write=print)
        feeder = Feeder(group, dataset.batches(1), cfg, total, first=step + 1, replay=in_flight)
        bar = tqdm(range(step + 1, total + 1), desc="train", unit="step", file=sys.stderr, dynamic_ncols=True)
        for step in bar:
            m: dict[str, Any] = {}
            bytes0 = group.bytes_moved
            profiling = step in (t.profile_steps or [])
            if profiling:
                group.start_profile()
            with timer("step", m):
                with timer("rollout", m):
                    feeder.fill(step)  # sync: this step's batch; one_step_off / async: also the next ones
                    outs = feeder.take(step, min_version=step - 1 - feeder.staleness)
                    summaries = [s for o in outs for s in o.summaries]
                    m["time/reward"] = max(o.reward_seconds for o in outs)
                    m["time/tools"] = max(o.tool_seconds for o in outs)
                    m.update(summarize(summaries))
                    lags = [step - 1 - s.oldest_version for s in summaries]  # the engine holds version step-1
                    m["rollout/policy_lag/mean"] = sum(lags) / max(1, len(lags))
                    m["rollout/policy_lag/max"] = float(max(lags, default=0))
                    m.update({k: sum(o.counts.get(k, 0.0) for o in outs) for k in set().union(*(o.counts for o in outs))})
                    engine_keys = set().union(*(o.engine for o in outs))  # counters: this step's, all replicas
                    m.update({k: sum(o.engine.get(k, 0.0) for o in outs) for k in engine_keys})
                    _check_infra_failures(summaries, t.max_infra_failure_fraction)
                with timer("log_probs", m):
                    m.update(group.compute_log_probs(n_mini))
                with timer("advantages", m):
                    adv = group.compute_advantages(kl_ctrl.value)
                    m.update(adv.metrics)
                    kl_ctrl.update(adv.kl, adv.sequences)
                if adv.sequences == 0:  # e.g. every group uniform under filter_groups: nothing to learn from
                    logger.warning("step %d: no sequence left to train on; skipping the update", step)
                else:
                    with timer("update", m):
                        per_rank = group.update(n_mini, step, step > t.critic_warmup)
                        m.update(_mean_over_ranks(per_rank, prefix="actor/"))
                with timer("weight_sync", m):  # also after a skipped update: it wakes the engine and bumps the version
                    m["time/weight_sync_worker"] = group.sync_weights(version=step)
            if profiling:
                logger.info("step %d profile: %s", step, ", ".join(group.stop_profile(str(run_dir / "profile"), step)))
            m.setdefault("actor/kl", m.get("actor/ppo_kl", 0.0))
            m["perf/driver_bytes"] = float(group.bytes_moved - bytes0)
            if (t.save_freq > 0 and step % t.save_freq == 0) or step == total:
                with timer("checkpoint", m):
                    last_ckpt = _save(group, run_dir, step, dataset, {"val_before": result.val_before,
                                      "kl_ctrl": kl_ctrl.state_dict(), "in_flight": feeder.in_flight(),
                                      "metrics": {k: v for k, v in m.items() if isinstance(v, (int, float))}})
            if t.test_freq > 0 and step % t.test_freq == 0 and step != total and val_samples:
                m.update(_validate(group, val_samples, cfg, step))
            tracker.log(step, m, write=bar.write)
            result.history.append(m)
        if val_samples:
            result.val_after = _validate(group, val_samples, cfg, total)
            tracker.log(total, result.val_after, write=print)
        result.export_dir = Path(group.export_hf(str(run_dir / "hf_model")))
    except Exception as e:  # WorkerFailure (dead worker / raising step), too many infra failures, disk full, ...
        where = f"last complete checkpoint: {last_ckpt}" if last_ckpt else "no checkpoint was written yet"
        if group is not None:
            group.shutdown(graceful=False)
            group = None
        raise TrainingError(f"training stopped at step {step}: {e}\n{where}; rerun the same command to resume "
                            "(trainer.resume_mode=auto)") from e
    finally:
        if group is not None:
            group.shutdown()
        if tracker is not None:
            tracker.close()
        if started_ray:
            import ray

            ray.shutdown()
    _print_summary(result, tracker)
    return result


class InfraFailureError(RuntimeError):
    """Too many of a step's trajectories failed for infrastructure reasons (trainer.max_infra_failure_fraction)."""


def _check_infra_failures(summaries: list, max_fraction: float) -> None:
    """Stop the step when infrastructure failures exceed their allowed share; name the main cause and an example."""
    failed = [s for s in summaries if s.outcome == "infra_failure"]
    if not summaries or len(failed) / len(summaries) <= max_fraction:
        return
    causes = Counter(s.cause for s in failed)
    cause, count = causes.most_common(1)[0]
    example = next(s for s in failed if s.cause == cause)
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

    rows = sum(1 for f in cfg.data.train_files for _ in iter_samples(f, prompt_key=cfg.data.prompt_key,
                                                                      skip_bad_rows=cfg.data.skip_bad_rows))
    cfg = cfg.model_copy(deep=True)
    cfg.trainer.total_training_steps = max(1, cfg.trainer.total_epochs * (rows // cfg.data.train_batch_size))
    return cfg


def _step_seed(seed: int, step: int) -> int:
    """Rollout seed of a step: a resumed run samples exactly what the uninterrupted run sampled."""
    return random.Random(f"{seed}:{step}").randrange(1 << 40)


def _mean_over_ranks(per_rank: list[dict[str, float]], prefix: str) -> dict[str, float]:
    keys = set().union(*per_rank) if per_rank else set()
    out = {}
    for k in keys:
        vals = [r[k] for r in per_rank if k in r]
        name = k if "/" in k else (("critic/" if k.startswith(("vf_", "critic_")) else prefix) + k)
        out[name] = sum(vals) / len(vals)
    return out


def _validate(group: WorkerGroup, samples: list, cfg: RunConfig, step: int) -> dict[str, float]:
    """Held-out rollouts with rollout.val_kwargs (greedy by default); metrics under val/."""
    from verl_agent.rollout.build import sampling_params

    r = cfg.actor_rollout_ref.rollout
    sampling = sampling_params(r, cfg.data, seed=_step_seed(cfg.trainer.seed, -1), validate=True)
    t0 = time.perf_counter()
    outs = group.validate(samples, r.val_kwargs.n, sampling, step)
    m = summarize([s for o in outs for s in o.summaries])
    out = {k.replace("rollout/", "val/", 1): v for k, v in m.items()}
    out["time/validation"] = time.perf_counter() - t0
    return out


class Feeder:
    """Feeds the workers batch after batch ahead of training, as trainer.mode asks, and tracks what is untrained.

    sync feeds batch k at step k; one_step_off also batch k+1 (it rolls out while k trains);
    async keeps trainer.max_staleness batches ahead. Batch k always gets the seed of step k, so
    a window of 0 reproduces a synchronous run exactly. Samples fed but not yet trained go into
    each checkpoint (`in_flight`); a resumed run feeds them first, so no sample is lost or
    trained twice.
    """

    def __init__(self, group: WorkerGroup, samples: Any, cfg: RunConfig, total: int, first: int,
                 replay: list[dict] | None = None) -> None:
        from verl_agent.protocol import Sample

        t = cfg.trainer
        self.group, self.samples, self.cfg, self.total = group, samples, cfg, total
        self.ahead = t.batches_ahead
        self.staleness = self.ahead
        self.counts: dict[int, list[int]] = {}  # batch -> prompts per rank (what `take` asks each rank for)
        self.untrained: dict[tuple[int, int], Any] = {}  # (batch, index in batch) -> Sample
        self.next = first
        self.replay = [Sample.from_dict(d) for d in replay or []]

    def fill(self, step: int) -> None:
        from verl_agent.rollout.build import sampling_params
        from verl_agent.trainer.controller import shard_sizes

        r, size = self.cfg.actor_rollout_ref.rollout, self.cfg.data.train_batch_size
        while self.next <= min(step + self.ahead, self.total):
            batch = [self.replay.pop(0) if self.replay else next(self.samples)[0] for _ in range(size)]
            sampling = sampling_params(r, self.cfg.data, seed=_step_seed(self.cfg.trainer.seed, self.next))
            self.counts[self.next] = self.group.feed(batch, r.n, sampling, batch=self.next)
            assert self.counts[self.next] == shard_sizes(size, self.group.rollout_shards)
            self.untrained.update({(self.next, i): s for i, s in enumerate(batch)})
            self.next += 1

    def take(self, step: int, min_version: int) -> list:
        counts = self.counts.pop(step)
        outs = self.group.take(counts, step, min_version)
        offsets = [sum(counts[:r]) for r in range(len(counts))]  # shard r holds the batch's prompts from here
        for rank, out in enumerate(outs):
            for batch, position in out.taken:
                del self.untrained[(batch, offsets[rank] + position)]
        return outs

    def in_flight(self) -> list[dict]:
        return [s.to_dict() for _, s in sorted(self.untrained.items(), key=lambda kv: kv[0])]


def _truncate_trajectory_logs(run_dir: Path, step: int) -> None:
    """On resume: drop trajectory logs of steps after the checkpoint (they are rolled out again)."""
    for path in (run_dir / "trajectories").glob("*step_*.jsonl"):
        if int(path.stem.rsplit("_", 1)[1]) > step:
            path.unlink()


def _resume_point(cfg: RunConfig) -> Path | None:
    """The checkpoint to resume from: trainer.resume_from_path (verified), or the newest complete one (auto)."""
    t = cfg.trainer
    if t.resume_mode == "disable":
        return None
    if t.resume_mode == "resume_path":
        problem = ckpt.verify(Path(t.resume_from_path)) if t.resume_from_path else "it is not set"
        if problem:
            raise TrainingError(f"trainer.resume_from_path={t.resume_from_path!r} is not a complete checkpoint: "
                                f"{problem}")
        return Path(t.resume_from_path)
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


def _resume(group: WorkerGroup, dataset, path: Path) -> dict:
    state = json.loads((path / "driver_state.json").read_text())
    group.load_checkpoint(str(path), state["step"])
    dataset.load_state_dict(state["data"])
    ckpt.restore_driver_rng(state)
    logger.info("resumed from %s (step %d)", path, state["step"])
    return state


class CheckpointWriteError(RuntimeError):
    """Writing a checkpoint failed (a worker died, a full disk, ...); the partial one was removed."""


def _save(group: WorkerGroup, run_dir: Path, step: int, dataset, extra: dict) -> Path:
    tmp = ckpt.tmp_dir(run_dir, step)
    try:
        group.save_checkpoint(str(tmp))
        return ckpt.finalize(tmp, ckpt.driver_state(step, dataset.state_dict(), extra))
    except Exception as e:
        ckpt.discard(tmp)
        raise CheckpointWriteError(f"writing checkpoint {tmp.name[: -len('.tmp')]} failed (the partial one was "
                                   f"removed): {e}") from e


def _print_summary(result: TrainResult, tracker: Tracker | None) -> None:
    b, a = result.val_before.get("val/success_rate"), result.val_after.get("val/success_rate")
    if b is not None and a is not None:
        print(f"held-out success rate: before {b:.1%} -> after {a:.1%} ({(a - b) * 100:+.1f} points)")
    calls_b, calls_a = result.val_before.get("val/tool_calls_total"), result.val_after.get("val/tool_calls_total")
    n_b, n_a = result.val_before.get("val/num_trajectories"), result.val_after.get("val/num_trajectories")
    if calls_b is not None and calls_a is not None and n_b and n_a:  # what tool-use RL changes first
        print(f"held-out tool calls per problem: before {calls_b / n_b:.2f} -> after {calls_a / n_a:.2f}")
    if tracker is not None:
        print(f"metrics: {tracker.path}" + (f"   tensorboard: {tracker.tb_dir}" if tracker.tb is not None else ""))
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
    except TrainingError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
