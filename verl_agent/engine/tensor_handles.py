"""Tensors handed to another process of the same host by handle, not by value.

CUDA tensors travel as CUDA IPC handles (the receiver maps the sender's device memory); CPU tensors
must live in shared memory under torch's "file_system" strategy, which names a file the receiver
opens (a file descriptor cannot cross HTTP or Ray). Either way the blob is a few hundred bytes per
tensor whatever its size, and the sender keeps the tensors alive (and unchanged) until the receiver
has copied them. Used by the SGLang engine's weight updates and by the split placement's weight push.
"""

from __future__ import annotations

import io
import math
import os
import pickle
import socket
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import torch
import torch.multiprocessing  # registers torch's reducers with ForkingPickler

__all__ = ["FlatSpec", "HandleStaging", "dumps_by_handle", "flat_specs", "flat_views", "loads_by_handle", "memory_key",
           "pack_flat", "share_cpu"]


@contextmanager
def _file_system_strategy() -> Iterator[None]:
    previous = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        torch.multiprocessing.set_sharing_strategy(previous)


def dumps_by_handle(named_tensors: Sequence[tuple[str, torch.Tensor]]) -> bytes:
    """Pickle (name, tensor) pairs by handle. CPU tensors must already be in shared memory (`share_cpu`).
    Unpickle each blob once: pickling takes one reference on the shared memory for the one receiver."""
    buf = io.BytesIO()
    with _file_system_strategy():
        ForkingPickler(buf).dump(list(named_tensors))
    return buf.getvalue()


def loads_by_handle(blob: bytes) -> list[tuple[str, torch.Tensor]]:
    """The receiving side of `dumps_by_handle`: tensors that share the sender's memory (copy before use ends)."""
    return pickle.loads(blob)


def share_cpu(t: torch.Tensor) -> torch.Tensor:
    """A shareable tensor: CUDA tensors as they are (contiguous); CPU tensors cloned into shared memory
    (never move the caller's own parameter storage into shared memory)."""
    t = t.detach()
    if t.is_cuda:
        return t.contiguous()
    with _file_system_strategy():
        return t.clone().share_memory_()


def memory_key(device: torch.device) -> str:
    """Equal for two processes exactly when one can map the other's tensors on `device` by handle: the
    same host (hostname and kernel boot id: two containers of one host differ, several Ray nodes in one
    container do not), and for CUDA the same physical card (Ray gives each actor its own
    CUDA_VISIBLE_DEVICES, so a GPU that is device 0 in both processes may still be two cards)."""
    boot_id = Path("/proc/sys/kernel/random/boot_id")
    host = f"{socket.gethostname()}/{boot_id.read_text().strip() if boot_id.exists() else ''}"
    if device.type == "cuda":
        return f"{host}/cuda/{torch.cuda.get_device_properties(device).uuid}"
    return f"{host}/{device.type}"


FlatSpec = tuple[str, torch.dtype, tuple[int, ...], int]  # name, dtype, shape, byte offset in a flat buffer
ALIGN = 64  # bytes: every tensor of a flat buffer starts aligned, whatever the dtypes before it


def flat_specs(bucket: Sequence[tuple[str, torch.Tensor]]) -> tuple[list[FlatSpec], int]:
    """Where each tensor of `bucket` goes in one flat byte buffer, and the buffer's size."""
    specs, total = [], 0
    for name, t in bucket:
        specs.append((name, t.dtype, tuple(t.shape), total))
        total += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    return specs, total


def flat_views(buf: torch.Tensor, specs: Sequence[FlatSpec]) -> list[tuple[str, torch.Tensor]]:
    """The tensors of a flat uint8 buffer laid out by `flat_specs` (views: they share its memory)."""
    out = []
    for name, dtype, shape, off in specs:
        n = math.prod(shape) * dtype.itemsize
        out.append((name, buf[off:off + n].view(dtype).view(shape)))
    return out


def pack_flat(bucket: Sequence[tuple[str, torch.Tensor]], buf: torch.Tensor, specs: Sequence[FlatSpec]
              ) -> list[tuple[str, torch.Tensor]]:  # fmt: skip
    """Copy `bucket` into `buf` (at least as large as `flat_specs` says); returns the views."""
    views = flat_views(buf, specs)
    for (_, t), (_, view) in zip(bucket, views):
        view.copy_(t.detach())
    return views


class HandleStaging:
    """One flat shared-memory buffer, reused, that CPU buckets are packed into before `dumps_by_handle`
    (one shared file per push instead of one per tensor). CUDA buckets need no staging: IPC maps
    the tensors where they are."""

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None

    def fits(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> bool:
        """Whether `pack` can take the bucket: always on CUDA; on CPU when /dev/shm has room for the staging
        buffer (a container's default is 64 MB, and writing past a full tmpfs kills the process with
        SIGBUS instead of raising)."""
        if all(t.is_cuda for _, t in bucket):
            return True
        need = flat_specs(bucket)[1]
        if self.buf is not None and self.buf.numel() >= need:
            return True
        st = os.statvfs("/dev/shm") if os.path.isdir("/dev/shm") else None
        return st is not None and st.f_bavail * st.f_frsize >= 2 * need  # twice: leave room for the others

    def pack(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """Views of the staging buffer holding copies of `bucket` (CUDA tensors pass through). The views are
        valid until the next `pack`: the receiver must have copied them by then. Check `fits` first."""
        if all(t.is_cuda for _, t in bucket):
            return [(n, t.detach().contiguous()) for n, t in bucket]
        specs, total = flat_specs(bucket)
        if self.buf is None or self.buf.numel() < total:
            self.buf = None  # free the old buffer before the bigger one
            with _file_system_strategy():
                self.buf = torch.empty(total, dtype=torch.uint8).share_memory_()
        return pack_flat(bucket, self.buf, specs)
