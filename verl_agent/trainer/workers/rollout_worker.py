"""Rollouts in the trainer: `RolloutHost` (an engine replica + agent loop + stream in this process) and
`RolloutWorker` (a Ray actor that owns one, for trainer.placement=split).

Placement (trainer.placement):
- ``colocated`` (default): every `TrainWorker` owns a RolloutHost on its own device; its engine
  sleeps while the actor trains (rollout.free_cache_engine) and trajectories never leave the rank.
- ``split``: ``trainer.rollout_workers`` RolloutWorkers in their own placement group (own CPU
  processes; on GPU ``trainer.rollout_gpus_per_worker`` GPUs each, a fraction of one shared with
  the train workers where only one is present). The engines never sleep. Finished GRPO groups go
  from the rollout workers to the train ranks through Ray's object store, never through the driver
  (`RolloutWorker.take` returns one object per train rank); train rank 0 streams the weights to
  every rollout worker after each update (`TrainWorker._push_weights`, `WeightSender`): by handle where the rollout
  worker can map rank 0's memory (same host; on GPU the same card), else by a broadcast in a
  process group of their own (`WeightGroup`: NCCL between GPUs, gloo on CPU).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, TypeVar

import ray
import torch

from verl_agent.protocol import Sample, Trajectory
from verl_agent.engine.contract import SamplingParams, counter_changes
from verl_agent.rollout.metrics import TrajectorySummary
from verl_agent.rollout.stream import Group, RolloutStream
from verl_agent.engine.tensor_handles import loads_by_handle, memory_key
from verl_agent.trainer.workers.sharding import shard_list

if TYPE_CHECKING:
    from verl_agent.config import RunConfig

logger = logging.getLogger(__name__)

R = TypeVar("R")

__all__ = ["RolloutHost", "RolloutResult", "RolloutWorker", "log_trajectories", "rollout_result"]


@dataclass
class RolloutResult:
    """What one shard's rollout sends to the driver: scalars per trajectory, not tokens."""

    summaries: list[TrajectorySummary] = field(default_factory=list)
    reward_seconds: float = 0.0  # summed over concurrent trajectories (they overlap)
    tool_seconds: float = 0.0
    counts: dict[str, float] = field(default_factory=dict)  # what the failure rules left out (prepare.train_seqs)
    engine: dict[str, float] = field(default_factory=dict)  # the engine's counters since the previous take
    taken: list[tuple[int, int]] = field(default_factory=list)  # (batch, position in this shard) per group


def rollout_result(groups: list[Group], dropped: int, host: RolloutHost) -> RolloutResult:
    trajs = [t for g in groups for t in g.trajectories]
    return RolloutResult(summaries=[TrajectorySummary.of(t) for t in trajs], reward_seconds=host.reward_seconds(),
                         tool_seconds=sum(turn.tool_seconds for t in trajs for turn in t.turns),
                         counts={"train/stale_groups_dropped": float(dropped)}, engine=host.engine_metrics(),
                         taken=[(g.batch, g.position) for g in groups])  # fmt: skip


class _TimedReward:
    """Wraps a RewardFunction and adds up the seconds spent in it (for the step's time breakdown)."""

    def __init__(self, fn: Any) -> None:
        self.fn, self.seconds = fn, 0.0

    def __call__(self, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.fn(**kwargs)
        finally:
            self.seconds += time.perf_counter() - t0

    async def acall(self, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return await self.fn.acall(**kwargs)
        finally:
            self.seconds += time.perf_counter() - t0


def log_trajectories(cfg: RunConfig, tokenizer: Any, trajs: list[Trajectory], name: str, step: int,
                     advantages: list | None = None) -> None:  # fmt: skip
    """trainer.log_trajectories: append to <run dir>/trajectories/<name> (processes append whole blocks)."""
    if cfg.trainer.log_trajectories and trajs:
        from verl_agent.protocol import RolloutBatch
        from verl_agent.rollout.records import write_records

        write_records(cfg.run_dir / "trajectories" / name, RolloutBatch(trajs), tokenizer, step=step,
                      advantages=advantages)


def engine_slots(cfg: RunConfig, shards: int) -> int:
    """rollout.max_num_seqs where it is unset: a KV slot for every trajectory one of `shards` engine replicas
    holds at once (its share of a batch x n x the batches in flight), and at least rollout.max_batch_size.

    Sized for sync alone, the async modes' batches fed ahead would queue for slots, and trajectories waiting
    on a tool would lose theirs. Device memory still caps the count (`kv_pool.plan_budget`)."""
    r = cfg.actor_rollout_ref.rollout
    share = -(-cfg.data.train_batch_size // shards)
    return max(r.max_batch_size, share * r.n * (1 + cfg.trainer.batches_ahead))


class RolloutHost:
    """An engine replica, its agent loop and a `RolloutStream`, served by an event loop on a thread of
    this process, so rollouts go on while the calling thread trains or answers Ray calls.

    `rank` offsets the engine's and the samples' seeds, so replicas never sample alike; `shards` is how many
    replicas share each batch (see `engine_slots`). `kv_cache_bytes`: the hf engine's KV budget (the train
    rank's `memory.plan_memory` on CPU), else the engine takes rollout.gpu_memory_utilization's share.
    `shared_weights`: the actor's tensors the hf engine's parameters point at instead of holding their own
    (one train rank, `shared_weights.engine_shares_weights`).
    """

    def __init__(self, cfg: RunConfig, rank: int, model_path: str, device: torch.device, shards: int,
                 kv_cache_bytes: int | None = None, shared_weights: dict[str, torch.Tensor] | None = None) -> None:
        from verl_agent.rollout.build import build_rollout
        from verl_agent.trainer.policy.fsdp import load_causal_lm

        if cfg.actor_rollout_ref.rollout.max_num_seqs is None:
            cfg = cfg.model_copy(deep=True)
            cfg.actor_rollout_ref.rollout.max_num_seqs = engine_slots(cfg, shards)
        self.cfg, self.rank, self.device = cfg, rank, device
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="rollout-loop", daemon=True).start()
        arr = cfg.actor_rollout_ref
        model: Any = model_path
        if arr.rollout.name == "hf":  # a plain (unsharded) replica of the policy in this process
            model = load_causal_lm(model_path, arr.rollout.dtype or arr.model.dtype,
                                   trust_remote_code=arr.model.trust_remote_code)
            if shared_weights is not None:  # one rank: the actor's tensors, no copy (weights/shared_weights.py)
                from verl_agent.trainer.weights.shared_weights import point_engine_at

                point_engine_at(model, shared_weights)
        parts = build_rollout(cfg, model=model, device=str(device), seed=cfg.trainer.seed + rank, own_server=True,
                              kv_cache_bytes=kv_cache_bytes)
        self.engine, self.tokenizer, self.agent = parts.engine, parts.tokenizer, parts.agent
        self.reward_timer = self.agent.reward_fn = _TimedReward(parts.reward_fn) if parts.reward_fn else None
        self._reward_seconds = 0.0
        self._engine_before: dict[str, float] = {}
        if arr.rollout.name == "sglang":
            self.run(self.engine.start())

        async def make_stream() -> RolloutStream:
            return RolloutStream(self.agent)

        self.stream = self.run(make_stream())

    def run(self, coro: Any) -> Any:
        """Run a coroutine on the rollout loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def feed(self, samples: list[Sample], n: int, sampling: SamplingParams, batch: int) -> None:
        if sampling.seed is not None:
            sampling = replace(sampling, seed=sampling.seed + self.rank * 1_000_003)
        self.loop.call_soon_threadsafe(self.stream.feed, samples, n, sampling, batch)

    def take(self, k: int, min_version: int) -> tuple[list[Group], int]:
        """The first k groups to finish, no older than min_version (see RolloutStream.take)."""
        return self.run(self.stream.take(k, min_version))

    def reward_seconds(self) -> float:
        """Seconds spent in the reward function since the last call."""
        total = self.reward_timer.seconds if self.reward_timer else 0.0
        out, self._reward_seconds = total - self._reward_seconds, total
        return out

    def engine_metrics(self) -> dict[str, float]:
        """The engine's counters' changes since the last call (the work of one step, validation included
        when it ran in between; in the async modes, whatever the engine did meanwhile)."""
        metrics = getattr(self.engine, "metrics", None)
        if metrics is None:
            return {}
        now = metrics()
        out, self._engine_before = counter_changes(self._engine_before, now), now
        return out

    def validate(self, samples: list[Sample], n: int, sampling: SamplingParams, chunk: int | None
                 ) -> list[Trajectory]:  # fmt: skip
        from verl_agent.rollout.build import rollout_in_chunks

        if sampling.seed is not None:
            sampling = replace(sampling, seed=sampling.seed + self.rank * 1_000_003)
        return self.run(rollout_in_chunks(self.agent, samples, n, sampling, chunk))

    def pause(self, drain: bool) -> None:
        """Stop generation for a weight update (see RolloutStream.pause) and make sure the engine is awake."""
        self.run(self.stream.pause(drain=drain))
        self.run(self.engine.wake_up())

    def load(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        self.run(self.engine.update_weights(bucket))

    def resume(self, version: int) -> None:
        """The engine now holds policy `version`: generation goes on."""
        self.agent.policy_version = version
        self.loop.call_soon_threadsafe(self.stream.resume)

    def sleep(self) -> None:
        """Free the engine's memory for the update; its weights are dropped, not kept: the weight sync after
        the update loads every parameter again. With LoRA the sync sends only the adapters, so the base
        weights are kept (on a GPU they wait in host memory). An engine reading the actor's tensors
        (`shared_weights`) frees its KV cache alone."""
        self.run(self.engine.sleep(discard_weights=self.cfg.actor_rollout_ref.model.lora_rank == 0))

    def close(self) -> None:
        self.run(self.stream.cancel())
        for tool in getattr(self.agent, "tools", {}).values():  # the agent-function loop has none of ours
            try:
                self.run(tool.shutdown())
            except Exception:  # one tool's failure must not keep the engine and the others alive
                logger.exception("tool %r: shutdown failed", tool.name)
        self.run(self.engine.close())
        self.loop.call_soon_threadsafe(self.loop.stop)


@ray.remote
class RolloutWorker:
    """One engine replica of the split placement (see the module docstring). `index` is its shard of
    every batch; its seeds are those of train rank `index` in the colocated placement, so one rollout
    worker feeding one train rank samples exactly what a colocated single rank samples."""

    def __init__(self, cfg: dict, index: int) -> None:
        from verl_agent.config import RunConfig

        self.cfg = RunConfig.model_validate(cfg)
        self.index = index
        logging.basicConfig(level=logging.INFO, format=f"[rollout {index}] %(levelname)s %(name)s: %(message)s")

    def setup(self) -> dict[str, Any]:
        from verl_agent.rollout.build import import_external_lib, resolve_model_path

        cfg = self.cfg
        gpu = cfg.trainer.n_gpus_per_node > 0 and cfg.trainer.device != "cpu"
        device = torch.device("cuda", 0) if gpu else torch.device("cpu")
        if gpu:
            torch.cuda.set_device(device)
        import_external_lib(cfg.actor_rollout_ref.model)
        self.host = RolloutHost(cfg, self.index, resolve_model_path(cfg.actor_rollout_ref.model.path), device,
                                shards=cfg.trainer.rollout_workers)
        return {"rollout_worker": self.index, "device": str(device), "node": ray.util.get_node_ip_address(),
                "memory": memory_key(device)}

    def feed(self, samples: list[Sample], n: int, sampling: SamplingParams, batch: int) -> None:
        self.host.feed(samples, n, sampling, batch)

    def take(self, k: int, min_version: int, n_parts: int) -> tuple:
        """k finished groups cut into n_parts contiguous parts (one per train rank, sizes differing by at most
        one), then this shard's `RolloutResult`; call with `.options(num_returns=n_parts + 1)`."""
        groups, dropped = self.host.take(k, min_version)
        return (*shard_list(groups, n_parts), rollout_result(groups, dropped, self.host))

    def validate(self, samples: list[Sample], n: int, sampling: SamplingParams, step: int, chunk: int | None
                 ) -> RolloutResult:  # fmt: skip
        if not samples:
            return RolloutResult()
        trajs = self.host.validate(samples, n, sampling, chunk)
        log_trajectories(self.cfg, self.host.tokenizer, trajs, f"val_step_{step}.jsonl", step)
        return RolloutResult(summaries=[TrajectorySummary.of(t) for t in trajs])

    def pause(self, drain: bool) -> None:
        self.host.pause(drain)

    def load_weights(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        self.host.load(bucket)

    def load_weights_by_handle(self, blob: bytes) -> None:
        """Load a bucket that train rank 0 shares by handle (`dumps_by_handle`); the copies are complete on
        return, so rank 0 may overwrite or free the memory behind the handles."""
        bucket = loads_by_handle(blob)
        self.host.load(bucket)
        if any(t.is_cuda for _, t in bucket):
            torch.cuda.synchronize()

    def join_weight_group(self, addr: str, port: int, rank: int, size: int) -> None:
        from verl_agent.trainer.weights.weight_group import WeightGroup

        self.weight_group = WeightGroup(addr, port, rank, size, self.host.device)

    def load_weights_broadcast(self, specs: list, total: int) -> None:
        """Receive one bucket from train rank 0's broadcast in the `WeightGroup` and load it."""
        self.host.load(self.weight_group.recv(specs, total))
        if self.host.device.type == "cuda":
            torch.cuda.synchronize()

    def resume(self, version: int) -> None:
        self.host.resume(version)

    def run(self, fn: Callable[..., R], *args: Any) -> R:
        """`fn(self, *args)` on this worker: a probe or an extension that needs its engine (tests, benches)."""
        return fn(self, *args)

    def shutdown(self) -> None:
        self.host.close()
