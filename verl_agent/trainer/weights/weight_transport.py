"""`WeightSender`: how a train rank's freshly updated weights reach the engines.

Colocated: every rank copies the full parameters, bucket by bucket, into its own engine replica
in memory (`to_local_engine`). Split: train rank 0 streams each bucket to every `RolloutWorker`
by the worker's route (`controller.weight_routes`): "handle" (CUDA IPC, or on CPU one shared-memory
staging buffer when /dev/shm has room; else the object store), "collective" (one broadcast in the
`WeightGroup`), "object_store" (put once, on the host) (`to_rollout_workers`). In both, no forward
pass of an engine ever sees half-updated weights: generation pauses first and resumes after.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import ray
import torch

from verl_agent.engine.tensor_handles import HandleStaging, dumps_by_handle, flat_specs

if TYPE_CHECKING:
    from verl_agent.config import RunConfig
    from verl_agent.trainer.workers.rollout_worker import RolloutHost
    from verl_agent.trainer.weights.weight_group import WeightGroup

__all__ = ["Bucket", "WeightSender", "pause_drains"]

Bucket = list[tuple[str, torch.Tensor]]


def pause_drains(cfg: RunConfig) -> bool:
    """Does a weight update let started trajectories finish first? one_step_off, or partial_rollout=false."""
    return cfg.trainer.mode == "one_step_off" or not cfg.trainer.partial_rollout


class WeightSender:
    """One train rank's end of the weight transports (see the module docstring); `rank` 0 alone sends
    in the split placement, the other ranks take part in the gathering only."""

    def __init__(self, rank: int, device: torch.device) -> None:
        self.rank, self.device = rank, device
        self.staging = HandleStaging()  # split placement, rank 0: CPU buckets shared with rollout workers
        self.weight_group: WeightGroup | None = None  # split, rank 0: when a rollout worker is routed there
        self.sent_bytes = 0  # bytes of the tensors one engine received in the last transfer

    def to_local_engine(self, host: RolloutHost, buckets: Iterable[Bucket], drain: bool, version: int,
                        previous: int) -> int:  # fmt: skip
        """Pause `host`'s rollouts (`drain`: let started trajectories finish), load every bucket into its
        engine and resume it; returns the policy version the engine holds now: `version`, or `previous`
        when loading failed."""
        host.pause(drain=drain)
        held = previous
        try:
            for bucket in self._counted(buckets):
                host.load(bucket)
            held = version
        finally:
            host.resume(held)
        return held

    def join_group(self, addr: str, port: int, size: int) -> None:
        """Rank 0, split placement: host the `WeightGroup` that rollout workers on other GPUs or hosts join."""
        from verl_agent.trainer.weights.weight_group import WeightGroup

        self.weight_group = WeightGroup(addr, port, 0, size, self.device)

    def to_rollout_workers(self, buckets: Iterable[Bucket], rollout_workers: list, routes: list[str]) -> None:
        """Split placement: stream `buckets` to every (already paused) RolloutWorker by its route.

        Collective (every rank gathers); rank 0 sends each bucket and waits until every rollout worker has
        loaded it before gathering the next."""
        for bucket in self._counted(buckets):
            if self.rank == 0:
                ray.get(self._send(bucket, rollout_workers, routes))

    def _counted(self, buckets: Iterable[Bucket]) -> Iterable[Bucket]:
        self.sent_bytes = 0
        for bucket in buckets:
            self.sent_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
            yield bucket

    def _send(self, bucket: Bucket, rollout_workers: list, routes: list[str]) -> list[Any]:
        """Start loading `bucket` on every rollout worker; the refs of the loading calls."""
        shared = self.staging.pack(bucket) if "handle" in routes and self.staging.fits(bucket) else None
        calls, members, far = [], [], []
        for worker, route in zip(rollout_workers, routes, strict=True):
            if route == "handle" and shared is not None:  # one pickle per receiver: each takes a reference
                calls.append(worker.load_weights_by_handle.remote(dumps_by_handle(shared)))
            else:
                (members if route == "collective" else far).append(worker)
        if far:
            ref = ray.put([(name, t.detach().cpu()) for name, t in bucket])
            calls += [w.load_weights.remote(ref) for w in far]
        if members:
            if self.weight_group is None:
                raise RuntimeError("a rollout worker is routed 'collective' but train rank 0 joined no WeightGroup")
            specs, total = flat_specs(bucket)
            receivers = [w.load_weights_broadcast.remote(specs, total) for w in members]
            self.weight_group.send(bucket, specs, total, receivers)
            calls += receivers
        return calls
