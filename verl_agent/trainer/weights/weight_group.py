"""`WeightGroup`: a process group of its own for the split placement's weight push, between train rank 0
(rank 0 here) and the rollout workers that cannot map its memory (on another GPU or host).

NCCL between GPUs, gloo on CPU. It is not the train ranks' default group (the rollout workers are not
part of that one), so it is built straight from a TCPStore hosted by train rank 0 and used through the
backend object: one broadcast of one flat buffer per bucket.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import ray
import torch
import torch.distributed as dist

from verl_agent.engine.tensor_handles import FlatSpec, flat_views, pack_flat

__all__ = ["WeightGroup"]


class WeightGroup:
    """Rank 0 `send`s buckets; ranks 1..size-1 `recv` them. Every member constructs it at the same time
    (the store waits for all of them)."""

    def __init__(self, addr: str, port: int, rank: int, size: int, device: torch.device,
                 timeout_s: float = 600.0) -> None:  # fmt: skip
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(addr, port, size, is_master=rank == 0, timeout=timeout)
        if device.type == "cuda":
            self.pg = dist.ProcessGroupNCCL(store, rank, size)
        else:
            self.pg = dist.ProcessGroupGloo(store, rank, size, timeout)
        self.rank, self.device = rank, device
        self.buf: torch.Tensor | None = None  # reused: grows to the largest bucket

    def _buffer(self, total: int) -> torch.Tensor:
        if self.buf is None or self.buf.numel() < total:
            self.buf = None
            self.buf = torch.empty(total, dtype=torch.uint8, device=self.device)
        return self.buf[:total]

    def send(self, bucket: Sequence[tuple[str, torch.Tensor]], specs: Sequence[FlatSpec], total: int,
             receivers: Sequence[Any] = ()) -> None:  # fmt: skip
        """Rank 0: broadcast `bucket` packed as `specs` says (the receivers were told the same specs).

        `receivers`: the Ray refs of the receiving calls. They are watched while the broadcast runs, so a
        receiver that fails or dies raises here, by name, at once: NCCL does not notice a peer that is
        gone or never joins, and would wait for its timeout."""
        buf = self._buffer(total)
        pack_flat(bucket, buf, specs)
        work = self.pg.broadcast([buf])
        while receivers and not work.is_completed():
            done, _ = ray.wait(list(receivers), num_returns=len(receivers), timeout=0.2)
            ray.get(done)  # raises the failure of a receiver that has already failed
        work.wait()

    def recv(self, specs: Sequence[FlatSpec], total: int) -> list[tuple[str, torch.Tensor]]:
        """Other ranks: the bucket rank 0 sends, as views of this group's buffer (valid until the next recv)."""
        buf = self._buffer(total)
        self.pg.broadcast([buf]).wait()
        return flat_views(buf, specs)
