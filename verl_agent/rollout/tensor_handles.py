"""Tensors handed to another process of the same host by handle, not by value.

CUDA tensors travel as CUDA IPC handles (the receiver maps the sender's device memory); CPU tensors
must live in shared memory under torch's "file_system" strategy, which names a file the receiver
opens (a file descriptor cannot cross HTTP or Ray). Either way the blob is a few hundred bytes per
tensor whatever its size, and the sender keeps the tensors alive (and unchanged) until the receiver
has copied them. Used by the SGLang engine's weight updates and by the split placement's weight push.
"""

from __future__ import annotations

import io
import os
import pickle
import socket
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import torch
import torch.multiprocessing  # registers torch's reducers with ForkingPickler

__all__ = ["HandleStaging", "dumps_by_handle", "loads_by_handle", "memory_key", "share_cpu"]


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


class HandleStaging:
    """One flat shared-memory buffer, reused, that CPU buckets are packed into before `dumps_by_handle`
    (one shared file per push instead of one per tensor). CUDA buckets need no staging: IPC maps
    the tensors where they are."""

    ALIGN = 64  # bytes: every tensor starts aligned, whatever the dtypes before it

    def __init__(self) -> None:
        self.buf: torch.Tensor | None = None

    def _layout(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> tuple[list[int], int]:
        offsets, total = [], 0
        for _, t in bucket:
            offsets.append(total)
            total += -(-t.numel() * t.element_size() // self.ALIGN) * self.ALIGN
        return offsets, total

    def fits(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> bool:
        """Whether `pack` can take the bucket: always on CUDA; on CPU when /dev/shm has room for the staging
        buffer (a container's default is 64 MB, and writing past a full tmpfs kills the process with
        SIGBUS instead of raising)."""
        if all(t.is_cuda for _, t in bucket):
            return True
        need = self._layout(bucket)[1]
        if self.buf is not None and self.buf.numel() >= need:
            return True
        st = os.statvfs("/dev/shm") if os.path.isdir("/dev/shm") else None
        return st is not None and st.f_bavail * st.f_frsize >= 2 * need  # twice: leave room for the others

    def pack(self, bucket: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """Views of the staging buffer holding copies of `bucket` (CUDA tensors pass through). The views are
        valid until the next `pack`: the receiver must have copied them by then. Check `fits` first."""
        if all(t.is_cuda for _, t in bucket):
            return [(n, t.detach().contiguous()) for n, t in bucket]
        offsets, total = self._layout(bucket)
        if self.buf is None or self.buf.numel() < total:
            self.buf = None  # free the old buffer before the bigger one
            with _file_system_strategy():
                self.buf = torch.empty(total, dtype=torch.uint8).share_memory_()
        out = []
        for (name, t), off in zip(bucket, offsets):
            view = self.buf[off:off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            view.copy_(t.detach())
            out.append((name, view))
        return out
