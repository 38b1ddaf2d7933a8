"""`TrainWorker`: the Ray actor of one train rank, a thin composition of the parts that do the work.

- `Policy` (policy.py): the FSDP2 actor (+ ref, + critic), optimizers and the training passes;
- `StepBatch` (step_batch.py): this rank's trajectories of the step, as training sequences;
- `RolloutHost` (rollout_worker.py): with trainer.placement=colocated, this rank's engine replica and
  its rollouts on an event-loop thread, so rollouts keep running while the actor trains;
- `WeightSender` (weight_transport.py): the weights into the local engine, or to the split rollout workers;
- `RankProfiler` (profiling.py) and the checkpoint functions (checkpoint.py).

Data stays where it was made: `feed` starts this rank's rollouts, `take` keeps the finished groups
of a step and answers with per-trajectory summaries (scalars); with trainer.placement=split the groups
come from the rollout workers instead (`_take_parts`). With rollout.free_cache_engine the local engine
sleeps (drops caches; on GPU its weights leave the device) while the actor trains.

The public methods are the steps the driver's `WorkerGroup` calls by the same name; the underscored
ones (`_node_address`, `_take_parts`, `_join_weight_group`, `_push_weights`) are that group's plumbing
inside its `create`, `take` and `sync_weights` (Ray calls them like any actor method). Every method except
`_node_address`, `feed`, `take`, `_take_parts`, `validate` and `run` is collective: call it on all ranks.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import ray
import torch
import torch.distributed as dist

from verl_agent.engine.contract import SamplingParams
from verl_agent.engine.tensor_handles import memory_key
from verl_agent.protocol import Sample
from verl_agent.rollout.metrics import TrajectorySummary
from verl_agent.trainer.persistence import checkpoint as ckpt
from verl_agent.trainer.policy.policy import AdvantageResult, Policy
from verl_agent.trainer.tracking.profiling import RankProfiler
from verl_agent.trainer.workers.rollout_worker import RolloutHost, RolloutResult, rollout_result
from verl_agent.trainer.policy.step_batch import StepBatch
from verl_agent.trainer.weights.weight_transport import WeightSender, pause_drains

logger = logging.getLogger(__name__)

__all__ = ["TrainWorker"]

R = TypeVar("R")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


@ray.remote
class TrainWorker:
    """One train rank: joins the process group in `setup`, then forwards each call to the part that owns it
    (see the module docstring). `version` is the policy version of the weights its engines hold."""

    def __init__(self, cfg: dict, rank: int, world_size: int) -> None:
        from verl_agent.config import RunConfig

        self.cfg = RunConfig.model_validate(cfg)
        self.rank, self.world_size = rank, world_size
        logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
        self.rollout: RolloutHost | None = None  # colocated: this rank's engine replica (split: none)
        self.version = 0  # the step whose update the engines hold

    def _node_address(self) -> tuple[str, int]:
        """(IP of this node, a free port): where rank 0 hosts the process-group rendezvous."""
        return ray.util.get_node_ip_address(), _free_port()

    def setup(self, master_addr: str, master_port: int) -> dict[str, Any]:
        """Join the process group, build the policy (sharded actor, ref, critic) and the rollout parts."""
        from torch.distributed.device_mesh import init_device_mesh

        from verl_agent.rollout.build import import_external_lib, load_tokenizer, resolve_model_path

        cfg, arr = self.cfg, self.cfg.actor_rollout_ref
        gpu = cfg.trainer.n_gpus_per_node > 0 and cfg.trainer.device != "cpu"
        self.device = torch.device("cuda", 0) if gpu else torch.device("cpu")
        if gpu:
            torch.cuda.set_device(self.device)
        dist.init_process_group("nccl" if gpu else "gloo", init_method=f"tcp://{master_addr}:{master_port}",
                                rank=self.rank, world_size=self.world_size)
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        torch.manual_seed(cfg.trainer.seed)
        import_external_lib(arr.model)
        self.model_path = resolve_model_path(arr.model.path)
        self.policy = Policy(cfg, self.rank, self.device, mesh, self.model_path)
        if cfg.trainer.placement == "colocated":
            from verl_agent.trainer.weights.shared_weights import actor_tensors, engine_shares_weights

            shared = actor_tensors(self.policy.actor, frozen_only=self.policy.lora) \
                if engine_shares_weights(cfg, self.device.type, self.world_size) else None
            self.rollout = RolloutHost(cfg, self.rank, self.model_path, self.device, shards=self.world_size,
                                       kv_cache_bytes=self.policy.memory.kv_cache_bytes, shared_weights=shared)
        tokenizer = self.rollout.tokenizer if self.rollout is not None else load_tokenizer(arr.model)
        self.batch = StepBatch(cfg, tokenizer)
        self.weights = WeightSender(self.rank, self.device)
        self.profiler = RankProfiler(self.rank, self.device)
        return {"rank": self.rank, "device": str(self.device), "node": ray.util.get_node_ip_address(),
                "node_id": ray.get_runtime_context().get_node_id(), "memory": memory_key(self.device),
                "num_parameters": self.policy.num_parameters, "pid": os.getpid(),
                "trainable_parameters": self.policy.num_trainable_parameters,
                "memory_plan": self.policy.memory_plan_info()}

    # -- rollout -------------------------------------------------------------------------------

    def feed(self, samples: list[Sample], n: int, sampling: SamplingParams, batch: int) -> None:
        """Start rollouts of this rank's prompts of batch `batch` (n per prompt); returns at once.

        A seed is offset by the rank so ranks never sample alike.
        """
        self._host().feed(samples, n, sampling, batch)

    def take(self, k: int, step: int, min_version: int) -> RolloutResult:
        """Wait for k finished groups at most `current version - min_version` versions old and keep them
        for this step's training; answers with their summaries. Stale groups are rolled out again."""
        host = self._host()
        groups, dropped = host.take(k, min_version)
        result = rollout_result(groups, dropped, host)
        result.counts.update(self.batch.keep(groups, step))
        return result

    def _take_parts(self, step: int, parts: list) -> dict[str, float]:
        """Split placement: keep the groups of `parts` (object refs from RolloutWorker.take) for this step."""
        return self.batch.keep([g for part in ray.get(parts) for g in part], step)

    def validate(self, samples: list[Sample], n: int, sampling: SamplingParams, step: int) -> RolloutResult:
        """Held-out rollouts (in chunks of data.val_batch_size over all ranks); nothing is kept for training."""
        if not samples:
            return RolloutResult()
        vbs = self.cfg.data.val_batch_size
        trajs = self._host().validate(samples, n, sampling, -(-vbs // self.world_size) if vbs else None)
        self.batch.log(trajs, f"val_step_{step}.jsonl", step)
        return RolloutResult(summaries=[TrajectorySummary.of(t) for t in trajs])

    def _host(self) -> RolloutHost:
        if self.rollout is None:
            raise RuntimeError("trainer.placement=split: rollouts run on the RolloutWorkers, not on train ranks")
        return self.rollout

    # -- training (collective) -----------------------------------------------------------------

    def compute_log_probs(self, n_minibatches: int) -> dict[str, float]:
        """Old, ref log-probs and values of this rank's sequences (see `Policy.compute_log_probs`); with
        rollout.free_cache_engine in sync mode the local engine sleeps first (async modes keep generating)."""
        cfg = self.cfg
        if self.rollout is not None and cfg.actor_rollout_ref.rollout.free_cache_engine and cfg.trainer.mode == "sync":
            self.rollout.sleep()
        return self.policy.compute_log_probs(self.batch.seqs, n_minibatches)

    def compute_advantages(self, kl_coef: float) -> AdvantageResult:
        """algorithm.adv_estimator on this rank's sequences (+ DAPO group filtering); batch-wide metrics."""
        self.batch.seqs, result = self.policy.compute_advantages(self.batch.seqs, kl_coef)
        self.batch.log_trained()
        return result

    def update(self, n_minibatches: int, step: int, update_actor_now: bool = True) -> dict[str, float]:
        """Critic then actor updates on this rank's sequences; one LR-scheduler step each."""
        metrics = self.policy.update(self.batch.seqs, n_minibatches, step, update_actor_now)
        self.batch.seqs = []
        self.batch.flush()  # the trained records, written while the update ran
        return metrics

    # -- weights (collective) -------------------------------------------------------------------

    def sync_weights(self, version: int) -> tuple[float, int]:
        """Colocated: gather the full parameters (LoRA: the adapters) bucket by bucket into this rank's engine
        as policy `version` (rollouts in flight pause first, see `WeightSender.to_local_engine`); (seconds,
        bytes the engine received)."""
        t0 = time.perf_counter()
        self.version = self.weights.to_local_engine(self._host(), self.policy.engine_weights(),
                                                    pause_drains(self.cfg), version, self.version)
        return time.perf_counter() - t0, self.weights.sent_bytes

    def _join_weight_group(self, addr: str, port: int, size: int) -> None:
        """Rank 0, split placement: host the `WeightGroup` that rollout workers on other GPUs or hosts join."""
        self.weights.join_group(addr, port, size)

    def _push_weights(self, version: int, rollout_workers: list, routes: list[str]) -> tuple[float, int]:
        """Split placement: stream the full parameters (LoRA: the adapters) to every (already paused)
        RolloutWorker by its route (`controller.weight_routes`); (seconds, bytes each engine received)."""
        t0 = time.perf_counter()
        self.weights.to_rollout_workers(self.policy.engine_weights(), rollout_workers, routes)
        self.version = version
        return time.perf_counter() - t0, self.weights.sent_bytes

    # -- profiling (trainer.profile_steps), checkpoints, export ---------------------------------

    def start_profile(self) -> None:
        self.profiler.start()

    def stop_profile(self, out_dir: str, step: int) -> str:
        """Write this rank's top ops and Chrome trace under `out_dir`; the table's path."""
        return self.profiler.stop(out_dir, step)

    def save_checkpoint(self, path: str) -> None:
        self.batch.flush()  # the records of the steps a resume skips are on disk with the checkpoint
        ckpt.save_policy(self.policy, Path(path), self.cfg.trainer.checkpoint_compression, self.rank)

    def load_checkpoint(self, path: str, step: int) -> None:
        """Load the checkpoint of `step` (its driver state's step: the engine's policy version from here on)."""
        ckpt.load_policy(self.policy, Path(path), self.rank)
        self.version = step  # not parsed from the folder name: resume_from_path may name it anything
        if self.rollout is not None:  # split: the driver pushes the weights to the rollout workers
            self.sync_weights(self.version)

    def export_hf(self, path: str) -> str | None:
        """Full policy in Hugging Face format (+ tokenizer), streamed; rank 0 writes and returns the path. With
        LoRA a PEFT adapter folder, and with trainer.export_merged_model the merged model at `path`_merged."""
        tok_path = self.cfg.actor_rollout_ref.model.tokenizer_path or self.model_path
        if self.policy.lora:
            merged = path + "_merged" if self.cfg.trainer.export_merged_model else None
            return ckpt.export_lora(self.policy.actor, self.model_path, str(tok_path), path, self.rank, merged)
        return ckpt.export_hf(self.policy.actor, self.model_path, str(tok_path), path, self.rank)

    def run(self, fn: Callable[..., R], *args: Any) -> R:
        """`fn(self, *args)` on this worker: a probe or an extension that needs the worker's parts (tests and
        benches read weights or engine log-probs this way); collective if `fn` is."""
        return fn(self, *args)

    def shutdown(self) -> None:
        try:
            if getattr(self, "batch", None) is not None:  # None: setup failed before it
                self.batch.flush()
        finally:
            if self.rollout is not None:
                self.rollout.close()
            if dist.is_initialized():
                dist.destroy_process_group()
