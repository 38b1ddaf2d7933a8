"""Memory whose addresses survive sleep: what lets the decode step's CUDA graphs outlive `sleep()`/`wake_up()`.

A CUDA graph replays kernels with the pointers it recorded. The engine's sleep frees the weights' and the
KV pool's device memory, so, with ordinary allocations, wake gets other addresses and every graph must be
recorded again. An `Arena` is a fixed range of virtual addresses whose backing memory is given back on
`release()` and taken again on `commit()`, at the same addresses; tensors carved from it stay valid views
across the two, and graphs recorded over them replay after a wake as before. The contents do not survive.

- CUDA: the driver's virtual memory management (cuMemAddressReserve, cuMemCreate, cuMemMap,
  cuMemSetAccess; cuMemUnmap and cuMemRelease to give it back), called through ctypes on libcuda, which
  every CUDA machine has (no extra package; torch's allocator has no way to give memory back while
  keeping its addresses, short of a compiled pluggable allocator).
- CPU: an anonymous mmap; `release()` hands its pages back to the kernel (madvise MADV_DONTNEED) and
  they read as zeros when touched again.

`ParamArena` moves a model's parameters into one arena and parks them across sleep.

When the last tensor over a CUDA arena goes (an engine closed, or a model shared between engines moved
into the next engine's arena), its memory is unmapped only after the device finished the work queued so
far: kernels run asynchronously, and a copy out of the old arena, or a step still reading it, would
otherwise read unmapped memory (an illegal memory access, reported later by an unrelated call).
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import weakref
from typing import Any

import torch

logger = logging.getLogger(__name__)

__all__ = ["Arena", "ArenaError", "ParamArena", "make_arena"]

ALIGN = 512  # bytes between carved tensors: vectorised loads and cuBLAS want aligned operands


class ArenaError(RuntimeError):
    """The driver refused a virtual-memory call (the message names it and the error)."""


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]  # fmt: skip


class _Prop(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]  # fmt: skip


class _Access(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_PINNED, _ON_DEVICE, _READ_WRITE = 1, 1, 3  # CU_MEM_ALLOCATION_TYPE_PINNED, CU_MEM_LOCATION_TYPE_DEVICE, ..._RW
_U64, _SIZE = ctypes.c_uint64, ctypes.c_size_t
_SIGNATURES = {
    "cuMemGetAllocationGranularity": (ctypes.POINTER(_SIZE), ctypes.POINTER(_Prop), ctypes.c_int),
    "cuMemAddressReserve": (ctypes.POINTER(_U64), _SIZE, _SIZE, _U64, ctypes.c_ulonglong),
    "cuMemAddressFree": (_U64, _SIZE),
    "cuMemCreate": (ctypes.POINTER(_U64), _SIZE, ctypes.POINTER(_Prop), ctypes.c_ulonglong),
    "cuMemRelease": (_U64,),
    "cuMemMap": (_U64, _SIZE, _SIZE, _U64, ctypes.c_ulonglong),
    "cuMemUnmap": (_U64, _SIZE),
    "cuMemSetAccess": (_U64, _SIZE, ctypes.POINTER(_Access), _SIZE),
    "cuGetErrorName": (ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)),
}
_driver: Any = None


def _cu(name: str, *args: Any) -> None:
    global _driver
    if _driver is None:
        lib = ctypes.CDLL("libcuda.so.1")
        for fn, argtypes in _SIGNATURES.items():
            getattr(lib, fn).argtypes, getattr(lib, fn).restype = argtypes, ctypes.c_int
        _driver = lib
    rc = getattr(_driver, name)(*args)
    if rc != 0:
        text = ctypes.c_char_p()
        _driver.cuGetErrorName(rc, ctypes.byref(text))
        raise ArenaError(f"{name} failed: {(text.value or b'?').decode()} ({rc})")


class _CudaRange:
    """A device address range as `__cuda_array_interface__`, for torch.as_tensor (no copy). The tensors over
    it keep it alive; when the last one goes, its finalizer unmaps the memory and frees the addresses. (It
    holds no reference to its `Arena`: a cycle through a tensor's storage would never be collected.)"""

    def __init__(self, ptr: int, nbytes: int, handle: list[int], device: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 2, "strides": None}  # fmt: skip
        # not at exit: the process's end frees it all, and the driver may be shutting down by then
        weakref.finalize(self, _cuda_free, ptr, nbytes, handle, device).atexit = False


class Arena:
    """`nbytes` of memory at fixed addresses on `device`, carved into tensors with `carve`; `release()` gives
    the memory back, `commit()` takes it again (contents undefined on CUDA, zeros on CPU)."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.device, self.used, self.committed = device, 0, True
        if device.type == "cuda":
            free_deferred()
            self._cuda_reserve(max(1, nbytes))
        else:
            self._mm = mmap.mmap(-1, max(1, nbytes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self.nbytes = len(self._mm)
            self.storage = torch.frombuffer(self._mm, dtype=torch.uint8)

    def _cuda_reserve(self, nbytes: int) -> None:
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        torch.cuda.synchronize(index)  # the primary context is current on this thread from here on
        self._prop = _Prop(type=_PINNED, location=_Location(_ON_DEVICE, index))
        self._access = _Access(location=_Location(_ON_DEVICE, index), flags=_READ_WRITE)
        gran = _SIZE()
        _cu("cuMemGetAllocationGranularity", ctypes.byref(gran), ctypes.byref(self._prop), 0)
        self.nbytes = -(-nbytes // gran.value) * gran.value
        ptr = _U64()
        _cu("cuMemAddressReserve", ctypes.byref(ptr), self.nbytes, 0, 0, 0)
        self._ptr, self._handle = ptr.value, [0]  # the handle of the memory mapped there (0: none)
        rng = _CudaRange(self._ptr, self.nbytes, self._handle, index)
        self.committed = False
        self.commit()
        self.storage = torch.as_tensor(rng, device=self.device)

    def carve(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """The next aligned piece of the arena as a tensor of `shape` and `dtype`."""
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        start = -(-self.used // ALIGN) * ALIGN
        if start + n > self.nbytes:
            raise ArenaError(f"arena of {self.nbytes} bytes has no room for {n} more (used {self.used})")
        self.used = start + n
        return self.storage[start : start + n].view(dtype).view(shape)

    def release(self) -> None:
        """Give the memory back; the addresses stay reserved. Waits for the device's queued work first."""
        if not self.committed:
            return
        if self.device.type == "cuda":
            free_deferred()
            torch.cuda.synchronize(self.device)
            _cu("cuMemUnmap", self._ptr, self.nbytes)
            _cu("cuMemRelease", self._handle[0])
            self._handle[0] = 0
        else:
            self._mm.madvise(mmap.MADV_DONTNEED)
        self.committed = False

    def commit(self) -> None:
        """Back the addresses with memory again (a no-op when they are)."""
        if self.committed:
            return
        if self.device.type == "cuda":
            handle = _U64()
            try:
                _cu("cuMemCreate", ctypes.byref(handle), self.nbytes, ctypes.byref(self._prop), 0)
            except ArenaError:  # torch's allocator may hold free blocks it cached (the trainer's): return them
                torch.cuda.empty_cache()
                _cu("cuMemCreate", ctypes.byref(handle), self.nbytes, ctypes.byref(self._prop), 0)
            try:
                _cu("cuMemMap", self._ptr, self.nbytes, 0, handle.value, 0)
                _cu("cuMemSetAccess", self._ptr, self.nbytes, ctypes.byref(self._access), 1)
            except ArenaError:
                _cu("cuMemRelease", handle.value)
                raise
            self._handle[0] = handle.value
        self.committed = True


_deferred: list[tuple[int, int, list[int], int]] = []  # frees that came during a graph capture on their thread


def _cuda_free(ptr: int, nbytes: int, handle: list[int], device: int) -> None:
    """Unmap and free an arena whose last tensor went, once the device finished the work queued so far (see
    the module docstring). During a graph capture on this thread a synchronize would end the capture with an
    error: the free then waits for the next arena call (`free_deferred`)."""
    try:
        if torch.cuda.is_current_stream_capturing():
            _deferred.append((ptr, nbytes, handle, device))
            return
        torch.cuda.synchronize(device)
        _unmap_and_free(ptr, nbytes, handle)
    except Exception:  # noqa: BLE001 - at interpreter exit the driver may be gone already
        pass


def _unmap_and_free(ptr: int, nbytes: int, handle: list[int]) -> None:
    if handle[0]:
        _cu("cuMemUnmap", ptr, nbytes)
        _cu("cuMemRelease", handle[0])
        handle[0] = 0
    _cu("cuMemAddressFree", ptr, nbytes)


def free_deferred() -> int:
    """Free the arenas whose last tensor went during a graph capture (after a synchronize); returns how many."""
    if not _deferred or torch.cuda.is_current_stream_capturing():
        return 0
    done, _deferred[:] = list(_deferred), []
    for device in sorted({d for *_, d in done}):
        torch.cuda.synchronize(device)
    for ptr, nbytes, handle, _ in done:
        _unmap_and_free(ptr, nbytes, handle)
    return len(done)


def make_arena(nbytes: int, device: torch.device, what: str) -> Arena | None:
    """An arena, or None (logged) where the driver refuses one: the caller then allocates as before."""
    try:
        return Arena(nbytes, device)
    except (ArenaError, OSError, RuntimeError) as e:
        logger.warning("no fixed-address memory for the %s (%s): CUDA graphs are recorded again after a wake", what, e)
        return None


def _blocks(model: Any, groups: list[list[torch.nn.Parameter]]) -> list[list[torch.nn.Parameter]]:
    """The model's parameters in carving order, each block laid out back to back: a group (of one dtype,
    every member a parameter of the model) as one block where its first member comes, the rest alone."""
    params = list(model.parameters())  # tied parameters appear once
    known = {id(p) for p in params}
    lead: dict[int, list[torch.nn.Parameter]] = {}
    for g in groups:
        if len(g) > 1 and all(id(p) in known for p in g) and len({p.dtype for p in g}) == 1:
            lead[id(g[0])] = g
    grouped = {id(p) for g in lead.values() for p in g}
    return [lead[id(p)] if id(p) in lead else [p] for p in params if id(p) in lead or id(p) not in grouped]


def _aligned_total(blocks: list[list[torch.nn.Parameter]]) -> int:
    return sum(-(-sum(p.numel() for p in b) * b[0].element_size() // ALIGN) * ALIGN for b in blocks)


class ParamArena:
    """A model's parameters in one `Arena` on `device`, moved there one at a time (at most one parameter
    exists twice). `park` before sleep, `restore` at wake: the parameters get the same addresses back."""

    def __init__(self, model: Any, arena: Arena, groups: list[list[torch.nn.Parameter]] | None = None) -> None:
        self.arena, self.host = arena, None
        self.params: list[tuple[torch.nn.Parameter, torch.Tensor, int]] = []  # param, its view, byte offset
        with torch.no_grad():
            for block in _blocks(model, groups or []):
                flat = arena.carve((sum(p.numel() for p in block),), block[0].dtype)
                at = 0
                for p in block:
                    view = flat[at : at + p.numel()].view(p.shape)
                    at += p.numel()
                    view.copy_(p.data)
                    self.params.append((p, view, view.data_ptr() - arena.storage.data_ptr()))
                    p.data = view

    @classmethod
    def adopt(cls, model: Any, device: torch.device, groups: list[list[torch.nn.Parameter]] | None = None
              ) -> ParamArena | None:  # fmt: skip
        """`model`'s parameters in a new arena on `device`; each of `groups` back to back (decode_step.py
        reads such a group as one tensor)."""
        arena = make_arena(_aligned_total(_blocks(model, groups or [])), device, "weights")
        return None if arena is None else cls(model, arena, groups)

    def park(self, keep: bool) -> None:
        """Free the device memory. keep: the parameters live on the host meanwhile (one copy of the whole
        arena); else they become empty (the caller loads them all again after `restore`)."""
        if keep:
            self.host = self.arena.storage[: self.arena.used].to("cpu")
            for p, view, offset in self.params:
                n = view.numel() * view.element_size()
                p.data = self.host[offset : offset + n].view(view.dtype).view(view.shape)
        else:
            for p, view, _ in self.params:
                p.data = torch.empty(0, dtype=view.dtype, device=view.device)
        self.arena.release()

    def restore(self) -> None:
        """Memory back at the same addresses; the host copy (if parked with keep) written back."""
        self.arena.commit()
        if self.host is not None:
            self.arena.storage[: self.arena.used].copy_(self.host, non_blocking=False)
            self.host = None
        for p, view, _ in self.params:
            p.data = view
