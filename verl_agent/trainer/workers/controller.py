"""The Ray single controller: start or join Ray, place the workers, shard data across them, gather results.

The driver process owns the RL loop (loop.py); the workers are `TrainWorker`
Ray actors that form one torch.distributed group. Placement: one placement
group with one bundle per node (``trainer.nnodes``), STRICT_SPREAD so each
bundle is a different node; a bundle holds that node's workers
(``trainer.n_gpus_per_node`` GPUs, or ``trainer.num_cpu_workers / nnodes`` CPUs
for CPU training). With trainer.placement=split, ``trainer.rollout_workers``
`RolloutWorker` actors get a second placement group, one bundle each (see
rollout_worker.py). Nothing here generates methods: the loop calls worker
methods directly through `WorkerGroup`'s typed methods (one per worker method).
"""

from __future__ import annotations

import logging
import os
import pickle
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from verl_agent.engine.contract import SamplingParams
from verl_agent.protocol import Sample
from verl_agent.trainer.policy.policy import AdvantageResult
from verl_agent.trainer.workers.rollout_worker import RolloutResult, RolloutWorker
from verl_agent.trainer.workers.sharding import shard_list
from verl_agent.trainer.weights.weight_transport import pause_drains
from verl_agent.trainer.workers.worker import TrainWorker

if TYPE_CHECKING:
    from verl_agent.config import RunConfig

logger = logging.getLogger(__name__)

__all__ = ["GroupCheckpoints", "WorkerGroup", "WorkerFailure", "cpus_needed", "init_ray", "weight_routes"]

R = TypeVar("R")


class WorkerFailure(RuntimeError):
    """A worker died or a worker call raised; the message names the call and the rank."""


def init_ray(address: str | None, min_cpus: int = 1) -> bool:
    """Join Ray at `address` ('auto' = a running cluster) or start a local one; True if we started it.

    A local instance gets at least `min_cpus` logical CPUs (one per worker actor, see `cpus_needed`), so a
    split placement with more actors than cores still starts on a small machine (the cores are shared).

    With no address (and no $RAY_ADDRESS) we always start a fresh local instance: Ray's own default
    would join whatever cluster `/tmp/ray/ray_current_cluster` names, and a stale file left by a dead
    cluster makes `ray.init()` hang for minutes waiting for its GCS. A local instance's session dir
    goes to a short temp path (Unix socket paths are limited to 107 bytes) and token auth is off (Ray
    would otherwise write an auth token under the home directory).
    """
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS") or "local"
    if address == "local":
        os.environ.setdefault("RAY_TMPDIR", os.path.join(tempfile.gettempdir(), "ray"))
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    local = {"num_cpus": max(os.cpu_count() or 1, min_cpus)} if address == "local" else {}
    ray.init(address=address, include_dashboard=False, log_to_driver=True, **local,
             runtime_env={"env_vars": {"NCCL_NVLS_ENABLE": "0", "TOKENIZERS_PARALLELISM": "false"}})
    return True


def cpus_needed(cfg: RunConfig) -> int:
    """Logical CPUs the workers of `cfg` ask Ray for on one node (CPU training; the split rollout workers)."""
    t = cfg.trainer
    train = t.n_gpus_per_node if t.n_gpus_per_node > 0 else t.num_cpu_workers // t.nnodes
    return train + (t.rollout_workers if t.placement == "split" else 0)


def weight_routes(transport: str, rank0: dict[str, Any], rollout_infos: Sequence[dict[str, Any]]) -> list[str]:
    """How train rank 0 sends the weights to each rollout worker (split placement): "handle" where it can
    map rank 0's memory (setup's `memory` keys match) and trainer.weight_transport is auto, else
    "collective" (a `WeightGroup` broadcast), or "object_store" for every worker when asked."""
    if transport == "object_store":
        return ["object_store"] * len(rollout_infos)
    return ["handle" if transport == "auto" and r["memory"] == rank0["memory"] else "collective"
            for r in rollout_infos]


@dataclass
class WorkerGroup:
    """`world_size` TrainWorkers in one process group, placed on `nnodes` nodes.

    Typed calls: each method below calls the worker method of the same name on every rank
    (rank i gets shard i where data is sharded) and returns typed results in rank order; `profile`
    wraps start_profile/stop_profile, and `checkpoints` (a `GroupCheckpoints`) the checkpoint and export
    calls. Only small things cross the driver boundary; `bytes_moved` counts them (pickled size of
    arguments and results, the same encoding Ray uses for them).
    """

    cfg: RunConfig
    workers: list = field(default_factory=list)
    pg: Any = None
    info: list[dict] = field(default_factory=list)
    bytes_moved: int = 0
    rollouts: list = field(default_factory=list)  # split placement: the RolloutWorkers
    routes: list[str] = field(default_factory=list)  # per RolloutWorker: how the weights reach it (weight_routes)
    rollout_pg: Any = None
    rollout_info: list[dict] = field(default_factory=list)
    sync_bytes: int = 0  # bytes one engine received in the last weight sync
    checkpoints: GroupCheckpoints = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.checkpoints = GroupCheckpoints(self)

    @property
    def world_size(self) -> int:
        return len(self.workers)

    @property
    def rollout_shards(self) -> int:
        """How many ways a batch is sharded for rollout: the rollout workers (split) or the train ranks."""
        return len(self.rollouts) or self.world_size

    @classmethod
    def create(cls, cfg: RunConfig, timeout_s: float = 300.0) -> WorkerGroup:
        t = cfg.trainer
        gpus = t.n_gpus_per_node
        per_node = gpus if gpus > 0 else t.num_cpu_workers // t.nnodes
        if per_node < 1 or (gpus == 0 and t.num_cpu_workers % t.nnodes):
            raise ValueError(f"trainer.num_cpu_workers={t.num_cpu_workers} must be a positive multiple of "
                             f"trainer.nnodes={t.nnodes}")
        split = t.placement == "split"
        # split on one GPU: a rollout worker's fraction of it leaves the rest to the train worker
        gpu_each = 1.0 - t.rollout_gpus_per_worker if split and gpus and t.rollout_gpus_per_worker < 1 else 1.0
        bundle = {"CPU": per_node} if gpus == 0 else {"GPU": per_node * gpu_each, "CPU": per_node}
        group = cls(cfg=cfg, pg=_placement(bundle, t.nnodes, "STRICT_SPREAD" if t.nnodes > 1 else "PACK", timeout_s))
        world = per_node * t.nnodes
        cfg_dict = cfg.model_dump()
        for rank in range(world):
            strategy = PlacementGroupSchedulingStrategy(group.pg, placement_group_bundle_index=rank // per_node)
            opts = {"num_cpus": 1, "num_gpus": gpu_each if gpus else 0, "scheduling_strategy": strategy}
            group.workers.append(TrainWorker.options(**opts).remote(cfg_dict, rank, world))
        try:
            if split:
                rgpu = t.rollout_gpus_per_worker if gpus else 0
                rbundle = {"CPU": 1, **({"GPU": rgpu} if rgpu else {})}
                group.rollout_pg = _placement(rbundle, t.rollout_workers, "PACK", timeout_s)
                for i in range(t.rollout_workers):
                    strategy = PlacementGroupSchedulingStrategy(group.rollout_pg, placement_group_bundle_index=i)
                    group.rollouts.append(RolloutWorker.options(num_cpus=1, num_gpus=rgpu, scheduling_strategy=strategy)
                                          .remote(cfg_dict, i))  # fmt: skip
            addr, port = group._get([group.workers[0]._node_address.remote()], "node_address")[0]
            setups = [w.setup.remote(addr, port) for w in group.workers] + [r.setup.remote() for r in group.rollouts]
            infos = group._get(setups, "setup")
            group.info, group.rollout_info = infos[:world], infos[world:]
            group.routes = weight_routes(t.weight_transport, group.info[0], group.rollout_info)
            group._join_weight_group()
            if cfg.actor_rollout_ref.model.lora_rank > 0:
                # the engines start from the base: give them the adapters now (lora_adapter_path's, or fresh ones:
                # unmerged, their matmuls are then in the first decode graphs, which every later step replays)
                group.sync_weights(version=0)
        except BaseException:  # never leak the workers' CPUs/GPUs to the next run in this cluster
            group.shutdown(graceful=False)
            raise
        logger.info("%d train workers ready: %s%s", world, [(i["rank"], i["node"], i["device"]) for i in
                    group.info], f"; rollout workers: {group.rollout_info}, weights: {group.routes}"
                    if split else "")  # fmt: skip
        return group

    # -- typed calls -----------------------------------------------------------------------------

    def feed(self, samples: Sequence[Sample], n: int, sampling: SamplingParams, batch: int) -> list[int]:
        """Start batch `batch`: prompts sharded contiguously over ranks (whole GRPO groups per rank);
        returns each rank's number of prompts (what its `take` for that batch asks for)."""
        shards = shard_list(samples, self.rollout_shards)
        self._count(shards, (n, sampling, batch) * self.rollout_shards)
        self._get([w.feed.remote(s, n, sampling, batch) for w, s in zip(self.rollouts or self.workers, shards)],
                  "feed")  # fmt: skip
        return [len(s) for s in shards]

    def take(self, counts: Sequence[int], step: int, min_version: int) -> list[RolloutResult]:
        """Each rollout shard hands over counts[shard] finished groups (no older than min_version) for this
        step; one result per shard. Colocated, the shards are the train ranks and keep their groups; split,
        each rollout worker's groups go straight to the train ranks (Ray object refs, not via the driver)."""
        if not self.rollouts:
            return self._get([w.take.remote(k, step, min_version) for w, k in zip(self.workers, counts)], "take")
        w = self.world_size
        outs = [r.take.options(num_returns=w + 1).remote(k, min_version, w) for r, k in zip(self.rollouts, counts)]
        kept = self._get([tw._take_parts.remote(step, [out[rank] for out in outs])
                          for rank, tw in enumerate(self.workers)], "take_parts")  # fmt: skip
        results = self._get([out[w] for out in outs], "take")
        for c in kept:  # what the train ranks' failure rules left out, summed into the first shard
            for key, v in c.items():
                results[0].counts[key] = results[0].counts.get(key, 0.0) + v
        return results

    def validate(self, samples: Sequence[Sample], n: int, sampling: SamplingParams, step: int) -> list[RolloutResult]:
        shards = shard_list(samples, self.rollout_shards)
        self._count(shards)
        if self.rollouts:
            vbs = self.cfg.data.val_batch_size
            chunk = -(-vbs // len(self.rollouts)) if vbs else None
            return self._get([r.validate.remote(s, n, sampling, step, chunk) for r, s in zip(self.rollouts, shards)],
                             "validate")  # fmt: skip
        return self._get([w.validate.remote(s, n, sampling, step) for w, s in zip(self.workers, shards)], "validate")

    def compute_log_probs(self, n_minibatches: int) -> dict[str, float]:
        """Batch-wide metrics (all-reduced on the workers: rank 0's answer is everyone's)."""
        return self._get([w.compute_log_probs.remote(n_minibatches) for w in self.workers], "compute_log_probs")[0]

    def compute_advantages(self, kl_coef: float) -> AdvantageResult:
        return self._get([w.compute_advantages.remote(kl_coef) for w in self.workers], "compute_advantages")[0]

    def update(self, n_minibatches: int, step: int, update_actor: bool) -> list[dict[str, float]]:
        """Per-rank update metrics."""
        return self._get([w.update.remote(n_minibatches, step, update_actor) for w in self.workers], "update")

    def sync_weights(self, version: int) -> float:
        """Push the actor's weights into every engine as policy `version`; the slowest rank's seconds
        (`sync_bytes`: what one engine received)."""
        if not self.rollouts:
            done = self._get([w.sync_weights.remote(version) for w in self.workers], "sync_weights")
        else:
            self._get([r.pause.remote(pause_drains(self.cfg)) for r in self.rollouts], "pause")
            try:
                done = self._get([w._push_weights.remote(version, self.rollouts, self.routes)
                                  for w in self.workers], "push_weights")  # fmt: skip
            finally:
                self._get([r.resume.remote(version) for r in self.rollouts], "resume")
        self.sync_bytes = done[0][1]
        return max(seconds for seconds, _ in done)

    @contextmanager
    def profile(self, out_dir: str, step: int) -> Iterator[list[str]]:
        """Profile every train rank over the block; on leaving it, the list it gave gets each rank's top-ops
        table (paths; Chrome traces beside them)."""
        self._get([w.start_profile.remote() for w in self.workers], "start_profile")
        tables: list[str] = []
        yield tables
        tables.extend(self._get([w.stop_profile.remote(out_dir, step) for w in self.workers], "stop_profile"))

    def run(self, fn: Callable[..., R], *args: Any, shards: Sequence[Any] | None = None) -> list[R]:
        """`fn(worker, *args)` on every train rank (`TrainWorker.run`), or with `shards`
        `fn(worker, shards[i], *args)` on rank i; the answers in rank order. For probes and extensions
        that need a worker's parts (tests, benches)."""
        if shards is not None and len(shards) != self.world_size:
            raise ValueError(f"run: {len(shards)} shards for {self.world_size} train ranks")
        self._count(shards, args)
        calls = [w.run.remote(fn, *([shards[rank]] if shards is not None else []), *args)
                 for rank, w in enumerate(self.workers)]
        return self._get(calls, f"run({getattr(fn, '__name__', fn)})")

    def run_on_rollouts(self, fn: Callable[..., R], *args: Any) -> list[R]:
        """`fn(rollout_worker, *args)` on every split rollout worker (`RolloutWorker.run`), in order."""
        return self._get([r.run.remote(fn, *args) for r in self.rollouts], f"run({getattr(fn, '__name__', fn)})")

    # -- plumbing --------------------------------------------------------------------------------

    def _join_weight_group(self) -> None:
        """Build the `WeightGroup` of train rank 0 and the rollout workers routed "collective" (if any)."""
        members = [r for r, route in zip(self.rollouts, self.routes) if route == "collective"]
        if not members:
            return
        addr, port = self._get([self.workers[0]._node_address.remote()], "node_address")[0]
        size = len(members) + 1
        self._get([self.workers[0]._join_weight_group.remote(addr, port, size)]
                  + [r.join_weight_group.remote(addr, port, i + 1, size) for i, r in enumerate(members)],
                  "join_weight_group")  # fmt: skip

    def _count(self, *objs: Any) -> None:
        self.bytes_moved += sum(len(pickle.dumps(o)) for o in objs)

    def _get(self, refs: list, what: str) -> list:
        """ray.get of one call per rank (refs in rank order); a failure names the rank and the call."""
        try:
            out = ray.get(refs)
        except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as e:
            raise _failure(refs, what, e) from e
        self._count(out)
        return out

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the workers (after a failure: kill at once, a dead one is already gone) and free the placement group."""
        try:
            if graceful:
                ray.get([w.shutdown.remote() for w in self.workers + self.rollouts], timeout=30)
        except Exception as e:  # workers may be dead after a failure; killing below is what matters
            logger.debug("worker shutdown: %r", e)
        for w in self.workers + self.rollouts:
            ray.kill(w)
        for pg in (self.pg, self.rollout_pg):
            if pg is not None:
                remove_placement_group(pg)
        self.workers, self.rollouts, self.pg, self.rollout_pg = [], [], None, None


@dataclass
class GroupCheckpoints:
    """A `WorkerGroup`'s checkpoints and export (`group.checkpoints`): collective calls on every train rank,
    kept apart from the group's steps of the RL loop."""

    group: WorkerGroup

    def save(self, path: str) -> None:
        g = self.group
        g._get([w.save_checkpoint.remote(path) for w in g.workers], "save_checkpoint")

    def load(self, path: str, step: int) -> None:
        """Load the checkpoint written at `step` (from its driver_state.json); the engines hold policy `step`."""
        g = self.group
        g._get([w.load_checkpoint.remote(path, step) for w in g.workers], "load_checkpoint")
        if g.rollouts:
            g.sync_weights(version=step)

    def export_hf(self, path: str) -> str:
        """Rank 0's export path."""
        g = self.group
        return g._get([w.export_hf.remote(path) for w in g.workers], "export_hf")[0]


def _placement(bundle: dict, count: int, strategy: str, timeout_s: float) -> Any:
    """A ready placement group of `count` copies of `bundle`, or WorkerFailure naming what did not fit."""
    pg = placement_group([dict(bundle) for _ in range(count)], strategy=strategy)
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise WorkerFailure(f"Ray could not place {count} x {bundle} ({strategy}) within {timeout_s:.0f} s; "
                            f"cluster resources: {ray.cluster_resources()}")
    return pg


def _failure(refs: list, what: str, first: Exception) -> WorkerFailure:
    """The root cause among the ranks' answers: a dead worker before the ranks whose collectives then failed.

    When one rank is killed its peers' next collective fails too (gloo sees the closed socket), and
    whichever answer ray.get met first is not necessarily the dead one; wait briefly for all.
    """
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=10)
    dead, raised = [], []
    for rank, ref in enumerate(refs):
        if ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as e:
                dead.append((rank, e))
            except ray.exceptions.RayTaskError as e:
                raised.append((rank, e))
    if dead:
        rank, e = dead[0]
        return WorkerFailure(f"worker rank {rank} died during {what}: {_actor_death(e)}")
    if raised:
        rank, e = raised[0]
        logger.error("%s raised on worker rank %d:\n%s", what, rank, e)  # the remote traceback, in full
        return WorkerFailure(f"{what} raised on worker rank {rank}: {_last_line(e)}")
    return WorkerFailure(f"{what} failed on a worker: {first}")


def _last_line(e: Exception) -> str:
    """A remote error's own last line ("OSError: [Errno 28] No space left on device"), not Ray's whole traceback."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip() and not ln.startswith(" ")]
    return next((ln for ln in reversed(lines) if ": " in ln), lines[-1] if lines else repr(e))


def _actor_death(e: Exception) -> str:
    """Ray's multi-line death notice cut to what identifies it: the process and how it exited."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    keep = [ln for ln in lines if ln.startswith(("pid:", "ip:"))]
    exit_line = next((ln for ln in lines if "exit type" in ln.lower() or "exit detail" in ln.lower()), "")
    detail = exit_line.split(" Some common causes")[0].split(" There are some potential root causes")[0]
    return "; ".join([lines[0] if lines else type(e).__name__] + keep + ([detail] if detail else []))
