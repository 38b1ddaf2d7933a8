"""The Ray single controller: start or join Ray, place the workers, shard data across them, gather results.

The driver process owns the RL loop (loop.py); the workers are `TrainWorker`
Ray actors that form one torch.distributed group. Placement: one placement
group with one bundle per node (``trainer.nnodes``), STRICT_SPREAD so each
bundle is a different node; a bundle holds that node's workers
(``trainer.n_gpus_per_node`` GPUs, or ``trainer.num_cpu_workers / nnodes`` CPUs
for CPU training). Nothing here generates methods: the loop calls worker
methods directly through `WorkerGroup.call` / `call_sharded`.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from verl_agent.trainer.worker import TrainWorker

logger = logging.getLogger(__name__)

__all__ = ["WorkerGroup", "WorkerFailure", "init_ray", "shard_list", "shard_sizes", "unshard"]

T = TypeVar("T")


class WorkerFailure(RuntimeError):
    """A worker died or a worker call raised; the message names the call and the rank."""


def init_ray(address: str | None) -> bool:
    """Join Ray at `address` ('auto' = a running cluster) or start a local one; True if we started it.

    With no address (and no $RAY_ADDRESS) we always start a fresh local instance: Ray's own default
    would join whatever cluster `/tmp/ray/ray_current_cluster` names, and a stale file left by a dead
    cluster makes `ray.init()` hang for minutes waiting for its GCS. A local instance's session dir
    goes to a short temp path (Unix socket paths are limited to 107 bytes) and token auth is off
    (FACTS.md).
    """
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS") or "local"
    if address == "local":
        os.environ.setdefault("RAY_TMPDIR", os.path.join(tempfile.gettempdir(), "ray"))
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address=address, include_dashboard=False, log_to_driver=True,
             runtime_env={"env_vars": {"NCCL_NVLS_ENABLE": "0", "TOKENIZERS_PARALLELISM": "false"}})
    return True


def shard_sizes(n: int, k: int) -> list[int]:
    q, r = divmod(n, k)
    return [q + (1 if i < r else 0) for i in range(k)]


def shard_list(items: Sequence[T], k: int) -> list[list[T]]:
    """Contiguous shards, sizes differing by at most one (rank i gets shard i)."""
    out, start = [], 0
    for size in shard_sizes(len(items), k):
        out.append(list(items[start:start + size]))
        start += size
    return out


def unshard(parts: Sequence[Sequence[T]]) -> list[T]:
    return [x for p in parts for x in p]


@dataclass
class WorkerGroup:
    """`world_size` TrainWorkers in one process group, placed on `nnodes` nodes."""

    cfg: Any  # RunConfig
    workers: list = field(default_factory=list)
    pg: Any = None
    info: list[dict] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return len(self.workers)

    @classmethod
    def create(cls, cfg: Any, timeout_s: float = 300.0) -> WorkerGroup:
        t = cfg.trainer
        gpus = t.n_gpus_per_node
        per_node = gpus if gpus > 0 else t.num_cpu_workers // t.nnodes
        if per_node < 1 or (gpus == 0 and t.num_cpu_workers % t.nnodes):
            raise ValueError(f"trainer.num_cpu_workers={t.num_cpu_workers} must be a positive multiple of "
                             f"trainer.nnodes={t.nnodes}")
        bundle = {"CPU": per_node} if gpus == 0 else {"GPU": per_node, "CPU": per_node}
        strategy = "STRICT_SPREAD" if t.nnodes > 1 else "PACK"
        pg = placement_group([dict(bundle) for _ in range(t.nnodes)], strategy=strategy)
        ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
        if not ready:
            remove_placement_group(pg)
            raise WorkerFailure(f"Ray could not place {t.nnodes} node(s) x {bundle} within {timeout_s:.0f} s; "
                                f"cluster resources: {ray.cluster_resources()}")
        world = per_node * t.nnodes
        group = cls(cfg=cfg, pg=pg)
        cfg_dict = cfg.model_dump()
        for rank in range(world):
            strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank // per_node)
            opts = {"num_cpus": 1, "num_gpus": 1 if gpus else 0, "scheduling_strategy": strategy}
            group.workers.append(TrainWorker.options(**opts).remote(cfg_dict, rank, world))
        addr, port = group.call_one(0, "node_address")
        group.info = group.call("setup", addr, port)
        logger.info("%d workers ready: %s", world, [(i["rank"], i["node"], i["device"]) for i in group.info])
        return group

    def _get(self, refs: list, what: str) -> list:
        try:
            return ray.get(refs)
        except ray.exceptions.RayActorError as e:
            raise WorkerFailure(f"a worker died during {what}: {e}") from e
        except ray.exceptions.RayTaskError as e:
            raise WorkerFailure(f"{what} raised on a worker: {e}") from e

    def call(self, method: str, *args: Any, **kwargs: Any) -> list:
        """The same call on every rank (collective methods); results in rank order."""
        return self._get([getattr(w, method).remote(*args, **kwargs) for w in self.workers], method)

    def call_one(self, rank: int, method: str, *args: Any) -> Any:
        return self._get([getattr(self.workers[rank], method).remote(*args)], method)[0]

    def call_sharded(self, method: str, shards: Sequence[Any], *args: Any, **kwargs: Any) -> list:
        """Rank i gets shards[i] as its first argument; results in rank order."""
        assert len(shards) == self.world_size, (len(shards), self.world_size)
        refs = [getattr(w, method).remote(s, *args, **kwargs) for w, s in zip(self.workers, shards)]
        return self._get(refs, method)

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the workers (after a failure: kill at once, a dead one is already gone) and free the placement group."""
        try:
            if graceful:
                ray.get([w.shutdown.remote() for w in self.workers], timeout=30)
        except Exception as e:  # workers may be dead after a failure; killing below is what matters
            logger.debug("worker shutdown: %r", e)
        for w in self.workers:
            ray.kill(w)
        if self.pg is not None:
            remove_placement_group(self.pg)
        self.workers = []
