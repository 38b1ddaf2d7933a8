"""`train(cfg)`: the whole RL loop, top to bottom, each phase in a named timing scope.

    rollout (n per prompt, on every rank's engine) -> old/ref log-probs (+ values)
    -> advantages (algorithm.adv_estimator) -> update (critic, actor) -> weight sync
    -> metrics -> checkpoint (trainer.save_freq) -> validation (trainer.test_freq)

The driver (this process) owns the loop; `WorkerGroup` holds the Ray workers.
A worker that dies or a step that raises stops the run with `TrainingError`
naming the step and the last complete checkpoint; rerunning the same command
resumes from it (trainer.resume_mode=auto).
"""

from __future__ import annotations

import logging
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verl_agent.config import RunConfig, save_config
from verl_agent.trainer import checkpoint as ckpt
from verl_agent.trainer.controller import WorkerGroup, init_ray, shard_list, unshard
from verl_agent.trainer.prepare import assign_advantages, attach, filter_groups, to_train_shards, train_metrics
from verl_agent.trainer.tracking import Tracker, timer

logger = logging.getLogger(__name__)

__all__ = ["TrainResult", "TrainingError", "train", "add_cli", "run_train_cli"]


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

    from verl_agent.data import StreamingDataset
    from verl_agent.rollout import summarize

    t = cfg.trainer
    run_dir = cfg.run_dir
    dataset = StreamingDataset(cfg.data.train_files, cfg.data.prompt_key, cfg.data.answer_key, cfg.data.shuffle,
                               cfg.data.seed, cfg.data.skip_bad_rows)
    cfg = _with_total_steps(cfg)
    total = cfg.trainer.total_training_steps
    save_config(cfg, run_dir / "config.yaml")
    val_samples = _load_val(cfg)
    started_ray = init_ray(t.ray_address)
    group, tracker, step, last_ckpt = None, None, 0, None
    result = TrainResult(run_dir=run_dir, steps=total)
    try:
        group = WorkerGroup.create(cfg)
        result.workers = group.info
        last_ckpt = _resume_point(cfg)
        if last_ckpt is not None:
            state = _resume(group, dataset, last_ckpt)
            step = result.resumed_from = state["step"]
            result.val_before = state.get("val_before", {})
        tracker = Tracker(run_dir, t.logger, append=step > 0)
        tracker.truncate_after(step)
        if step == 0 and t.val_before_train and val_samples:
            result.val_before = _validate(group, val_samples, cfg, summarize)
            tracker.log(0, result.val_before, write=print)
        batches = dataset.batches(cfg.data.train_batch_size)
        rollout_cfg = cfg.actor_rollout_ref.rollout
        bar = tqdm(range(step + 1, total + 1), desc="train", unit="step", file=sys.stderr, dynamic_ncols=True)
        for step in bar:
            m: dict[str, Any] = {}
            with timer("step", m):
                samples = next(batches)
                with timer("rollout", m):
                    sampling = {"temperature": rollout_cfg.temperature, "top_p": rollout_cfg.top_p,
                                "top_k": rollout_cfg.top_k, "seed": _step_seed(t.seed, step)}
                    outs = group.call_sharded("rollout", shard_list(samples, group.world_size), rollout_cfg.n, sampling)
                    trajs = [o[0] for o in outs]
                    m["time/reward"] = max(o[1] for o in outs)
                    m["time/tools"] = max(o[2] for o in outs)
                    m.update(summarize(_batch(unshard(trajs))))
                shards, m["rollout/dropped"] = to_train_shards(trajs)
                with timer("log_probs", m):
                    attach(shards, group.call_sharded("compute_log_probs", shards))
                    m.update(train_metrics(unshard(shards)))
                with timer("advantages", m):
                    m.update(assign_advantages(unshard(shards), cfg.algorithm))
                    if cfg.algorithm.filter_groups.enable:
                        shards, m["rollout/kept_fraction"] = filter_groups(shards)
                with timer("update", m):
                    n_mini = max(1, cfg.data.train_batch_size // cfg.actor_rollout_ref.actor.ppo_mini_batch_size)
                    per_rank = group.call_sharded("update", shards, n_mini, step > t.critic_warmup)
                    m.update(_mean_over_ranks(per_rank, prefix="actor/"))
                with timer("weight_sync", m):
                    m["time/weight_sync_worker"] = max(group.call("sync_weights"))
            m.setdefault("actor/kl", m.get("actor/ppo_kl", 0.0))
            if (t.save_freq > 0 and step % t.save_freq == 0) or step == total:
                with timer("checkpoint", m):
                    last_ckpt = _save(group, run_dir, step, dataset, result.val_before)
            if t.test_freq > 0 and step % t.test_freq == 0 and step != total and val_samples:
                m.update(_validate(group, val_samples, cfg, summarize))
            tracker.log(step, m, write=bar.write)
            result.history.append(m)
        if val_samples:
            result.val_after = _validate(group, val_samples, cfg, summarize)
            tracker.log(total, result.val_after, write=print)
        result.export_dir = Path(group.call("export_hf", str(run_dir / "hf_model"))[0])
    except Exception as e:  # WorkerFailure (dead worker / raising step) or a driver-side error
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


def _load_val(cfg: RunConfig) -> list:
    from verl_agent.data import load_samples

    return [s for f in cfg.data.val_files for s in load_samples(f, prompt_key=cfg.data.prompt_key,
                                                                  answer_key=cfg.data.answer_key)]


def _step_seed(seed: int, step: int) -> int:
    """Rollout seed of a step: a resumed run samples exactly what the uninterrupted run sampled."""
    return random.Random(f"{seed}:{step}").randrange(1 << 40)


def _batch(trajs: list):
    from verl_agent.protocol import RolloutBatch

    return RolloutBatch(trajectories=trajs)


def _mean_over_ranks(per_rank: list[dict[str, float]], prefix: str) -> dict[str, float]:
    keys = set().union(*per_rank) if per_rank else set()
    out = {}
    for k in keys:
        vals = [r[k] for r in per_rank if k in r]
        name = k if "/" in k else (("critic/" if k.startswith(("vf_", "critic_")) else prefix) + k)
        out[name] = sum(vals) / len(vals)
    return out


def _validate(group: WorkerGroup, samples: list, cfg: RunConfig, summarize) -> dict[str, float]:
    """Held-out rollouts with rollout.val_kwargs (greedy by default); metrics under val/."""
    vk = cfg.actor_rollout_ref.rollout.val_kwargs
    sampling = {"temperature": vk.temperature if vk.do_sample else 0.0, "top_p": vk.top_p, "top_k": vk.top_k,
                "seed": _step_seed(cfg.trainer.seed, -1)}
    t0 = time.perf_counter()
    outs = group.call_sharded("rollout", shard_list(samples, group.world_size), vk.n, sampling)
    m = summarize(_batch(unshard([o[0] for o in outs])))
    out = {k.replace("rollout/", "val/", 1): v for k, v in m.items()}
    out["time/validation"] = time.perf_counter() - t0
    return out


def _resume_point(cfg: RunConfig) -> Path | None:
    t = cfg.trainer
    if t.resume_mode == "disable":
        return None
    if t.resume_mode == "resume_path":
        if not t.resume_from_path or not (Path(t.resume_from_path) / "driver_state.json").is_file():
            raise TrainingError(f"trainer.resume_from_path={t.resume_from_path!r} is not a complete checkpoint")
        return Path(t.resume_from_path)
    return ckpt.latest_checkpoint(cfg.run_dir)


def _resume(group: WorkerGroup, dataset, path: Path) -> dict:
    import json

    state = json.loads((path / "driver_state.json").read_text())
    group.call("load_checkpoint", str(path))
    dataset.load_state_dict(state["data"])
    ckpt.restore_driver_rng(state)
    logger.info("resumed from %s (step %d)", path, state["step"])
    return state


def _save(group: WorkerGroup, run_dir: Path, step: int, dataset, val_before: dict) -> Path:
    tmp = ckpt.tmp_dir(run_dir, step)
    group.call("save_checkpoint", str(tmp))
    return ckpt.finalize(tmp, ckpt.driver_state(step, dataset.state_dict(), {"val_before": val_before}))


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
