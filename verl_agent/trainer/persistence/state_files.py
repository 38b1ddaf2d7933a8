"""One rank's share of a model + optimizer state as bare bytes in a few files, streamed both ways.

`save_state` writes every tensor of this rank (its local FSDP shard, or the whole tensor when it is not
sharded) into ``threads`` files at once, each through one reused staging buffer (pinned for device
tensors), fsynced by its writer thread; host memory never holds more than the staging buffers. An index,
``rank{r}.json``, records for every tensor its file, offset, dtype, local shape, global shape, first row
in the global tensor (dim-0 sharding, as FSDP2's) and CRC32; a tensor under two names (tied weights) is
written once and indexed twice. Non-tensor state (optimizer param groups)
goes to ``objects.pt``, written by rank 0.

`load_state` fills a state of the same structure (this rank's current shards) from those files: the rows
each local shard needs are read from whichever saved ranks hold them, so a checkpoint written by N ranks
loads on M. Every tensor read is checked against its CRC32; a mismatch, a missing tensor or another shape
raises naming the tensor and the file.

With ``codec="zstd"`` each staged chunk is stored as byte planes (byte j of every element together): the
most significant plane (sign and exponent of a float: a few distinct values) is compressed with zstd, the
others are written as they are (mantissa bytes are noise). This shrinks float states (bf16 weights, AdamW
moments) enough to speed up a disk-bound save wherever the cores keep up with the compression.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

__all__ = ["save_state", "load_state", "resolve_codec", "write_back"]

STAGING_BYTES = 64 << 20  # a multiple of every element size: chunks hold whole elements
INDEX = "rank{}.json"
OBJECTS = "objects.pt"
CODECS = ("none", "zstd")


def resolve_codec(codec: str) -> str:
    """'auto' -> 'zstd' where this process may use 8 or more cores (compression then outruns the disk) and
    the `zstandard` package is installed, else 'none'."""
    if codec == "auto":
        return "zstd" if len(os.sched_getaffinity(0)) >= 8 and importlib.util.find_spec("zstandard") else "none"
    if codec not in CODECS:
        raise ValueError(f"state_files: unknown codec {codec!r}; expected auto or one of {CODECS}")
    if codec == "zstd" and not importlib.util.find_spec("zstandard"):
        raise ImportError("state_files: trainer.checkpoint_compression=zstd needs the zstandard package "
                          "(pip install zstandard)")
    return codec


def save_object(obj: Any, path: Path) -> None:
    """``torch.save`` through memory, then one plain write: a full disk raises ``OSError`` [Errno 28] naming
    the file, where torch's own file writer says only "unexpected pos ..."."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    with open(path, "wb") as f:
        f.write(buf.getbuffer())


def write_back(f, data: memoryview) -> None:
    """Write `data` and start its writeback now: the kernel would otherwise let dirty pages pile up to its
    background threshold (a share of RAM) before the disk gets any, and the final fsync would wait for all
    of them."""
    offset = f.tell()
    f.write(data)
    f.flush()
    try:
        os.posix_fadvise(f.fileno(), offset, len(data), os.POSIX_FADV_DONTNEED)  # Linux: starts writeback
    except OSError:  # a file system without it: the closing fsync still makes the file durable
        pass


def _planes(chunk: torch.Tensor, esize: int, out: torch.Tensor) -> torch.Tensor:
    """Byte planes of `chunk` (uint8, whole elements of `esize` bytes) in `out`: row j = byte j of each element
    (little-endian, so the last row is the most significant byte)."""
    n = chunk.numel() // esize
    planes, elements = out[:chunk.numel()].view(esize, n), chunk.view(n, esize)
    for j in range(esize):  # one strided column at a time: cheaper than one transposing copy
        planes[j].copy_(elements[:, j])
    return planes


def _flatten(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(path, leaf) for every leaf of nested dicts; paths join keys with '/' (parameter names use dots)."""
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flatten(v, f"{prefix}/{k}" if prefix else str(k))
    else:
        yield prefix, tree


def _local(t: torch.Tensor) -> tuple[torch.Tensor, int | None]:
    """This rank's part of `t` and its first row in the global tensor (None: not sharded, a whole copy)."""
    if not hasattr(t, "to_local"):
        return t.detach(), None
    from torch.distributed.tensor import Shard

    if len(t.placements) != 1 or t.placements[0] != Shard(0):
        raise ValueError(f"state_files: only 1-D meshes sharded on dim 0 (FSDP2) are supported, got {t.placements}")
    rows = -(-t.shape[0] // t.device_mesh.size())  # torch.chunk: every rank but the last gets ceil(N / W)
    return t.to_local().detach(), min(t.device_mesh.get_coordinate()[0] * rows, t.shape[0])


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


_Item = tuple[str, Any, torch.Tensor, "int | None"]  # (path in the state, leaf, its local shard, first row)


def save_state(directory: Path, state: dict, rank: int, world_size: int, threads: int | None = None,
               codec: str = "none") -> None:
    """Write this rank's tensors of `state` (nested dicts; DTensor or plain leaves) into `directory`, into
    `threads` files at once (default 8, 16 with zstd: compressing threads leave the disk idle meanwhile)."""
    codec = resolve_codec(codec)
    threads = threads or (16 if codec == "zstd" else 8)
    if codec == "zstd":
        import sys

        assert sys.byteorder == "little", "state_files: byte planes assume a little-endian host"
    directory.mkdir(parents=True, exist_ok=True)
    tensors, objects, aliases = _collect(state)
    if rank == 0:
        save_object(objects, directory / OBJECTS)
    files = _balance(tensors, threads)
    if any(local.is_cuda for _, _, local, _ in tensors):
        torch.cuda.synchronize()  # the optimizer's last kernels wrote these tensors on the default stream
    with ThreadPoolExecutor(threads) as pool:
        parts = pool.map(lambda i: _write_file(directory / f"rank{rank}_{i}.bin", files[i], codec), range(threads))
        index = {path: entry for part in parts for path, entry in part.items()}
    index.update({path: index[original] for path, original in aliases.items()})
    meta = {"format": 1, "codec": codec, "rank": rank, "world_size": world_size, "tensors": index}
    (directory / INDEX.format(rank)).write_text(json.dumps(meta))


def _collect(state: dict) -> tuple[list[_Item], dict[str, Any], dict[str, str]]:
    """The tensors of `state` to write, its other leaves, and the aliases: tied weights (embeddings = LM
    head) appear under two names, and their bytes are written once."""
    tensors, objects, aliases, seen = [], {}, {}, {}
    for path, leaf in _flatten(state):
        if not torch.is_tensor(leaf):
            objects[path] = leaf
            continue
        local, row = _local(leaf)
        key = (local.data_ptr(), local.dtype, tuple(local.shape), local.stride()) if local.numel() else None
        if key is not None and key in seen:
            aliases[path] = seen[key]
            continue
        seen[key] = path
        tensors.append((path, leaf, local, row))
    return tensors, objects, aliases


def _balance(tensors: list[_Item], threads: int) -> list[list[_Item]]:
    """Tensors over `threads` files by bytes: largest first, each to the least loaded file."""
    load = [0] * threads
    files: list[list[_Item]] = [[] for _ in range(threads)]
    for item in sorted(tensors, key=lambda item: -item[2].nbytes):
        target = load.index(min(load))
        files[target].append(item)
        load[target] += item[2].nbytes
    return files


def _write_file(file: Path, items: list[_Item], codec: str) -> dict[str, dict]:
    """Write `items` into `file` through one staging buffer (pinned, for GPU tensors), fsynced; their index."""
    index: dict[str, dict] = {}
    device = next((local.device for _, _, local, _ in items if local.is_cuda), None)
    stream = torch.cuda.Stream(device) if device is not None else None  # a new thread's current device is 0
    buf = torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True) if device is not None else None
    planes_buf = compressor = None
    if codec == "zstd":
        import zstandard

        planes_buf, compressor = torch.empty(STAGING_BYTES, dtype=torch.uint8), zstandard.ZstdCompressor(level=1)
    with open(file, "wb") as f:
        for path, leaf, local, row in items:
            flat, crc, offset, frames = _as_bytes(local), 0, f.tell(), []
            for start in range(0, flat.numel(), STAGING_BYTES):
                part = flat[start:start + STAGING_BYTES]
                if part.is_cuda:
                    with torch.cuda.stream(stream):
                        buf[:part.numel()].copy_(part, non_blocking=True)
                    stream.synchronize()
                    part = buf[:part.numel()]
                crc = zlib.crc32(memoryview(part.numpy()), crc)
                if compressor is not None:
                    planes = _planes(part, local.element_size(), planes_buf)
                    frame = compressor.compress(memoryview(planes[-1].numpy()))
                    write_back(f, memoryview(frame))
                    frames.append(len(frame))
                    part = planes[:-1].reshape(-1)  # the other planes, as they are (contiguous rows)
                write_back(f, memoryview(part.numpy()))
            index[path] = {"file": file.name, "offset": offset, "nbytes": flat.numel(), "dtype": str(local.dtype),
                           "shape": list(local.shape), "global_shape": list(leaf.shape), "row": row,
                           "crc32": crc, "stored": f.tell() - offset}  # fmt: skip
            if compressor is not None:  # bytes of each chunk's compressed plane; the chunk size, for the reader
                index[path].update(zstd_frames=frames, chunk_bytes=STAGING_BYTES)
        f.flush()
        os.fsync(f.fileno())
    return index


def load_state(directory: Path, state: dict, threads: int | None = None) -> dict:
    """Fill the tensors of `state` (this rank's current shards) in place from `directory`, `threads` tensors
    at once (default 8, 16 for zstd files); returns `state` with its non-tensor leaves replaced by the saved
    ones."""
    saved = [json.loads(p.read_text()) for p in sorted(directory.glob(INDEX.format("*")))]
    if not saved:
        raise FileNotFoundError(f"state_files: no {INDEX.format('*')} index in {directory}")
    threads = threads or (16 if any(meta.get("codec") == "zstd" for meta in saved) else 8)
    by_path: dict[str, list[dict]] = {}
    for meta in saved:
        for path, entry in meta["tensors"].items():
            by_path.setdefault(path, []).append(entry)
    objects = torch.load(directory / OBJECTS, weights_only=True)
    targets = []
    for path, leaf in _flatten(state):
        if torch.is_tensor(leaf):
            local, row = _local(leaf)
            if path not in by_path:
                raise KeyError(f"state_files: {directory} has no tensor {path!r}")
            targets.append((path, leaf, local, row))
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda item: _fill(directory, by_path[item[0]], item),
                      sorted(targets, key=lambda item: -item[2].nbytes)))
    if any(local.is_cuda for _, _, local, _ in targets):
        torch.cuda.synchronize()
    return _replace_objects(state, objects)


def _read(directory: Path, entry: dict, path: str) -> torch.Tensor:
    """One saved tensor (a rank's shard) as its index `entry` describes it, CRC32-checked."""
    dtype = getattr(torch, entry["dtype"].removeprefix("torch."))
    data = torch.empty(entry["nbytes"], dtype=torch.uint8)
    stored = data if "zstd_frames" not in entry else torch.empty(entry["stored"], dtype=torch.uint8)
    with open(directory / entry["file"], "rb") as f:
        f.seek(entry["offset"])
        if f.readinto(memoryview(stored.numpy())) != stored.numel():
            raise ValueError(f"state_files: {entry['file']} ends inside tensor {path!r} (truncated)")
    if "zstd_frames" in entry:
        _unplane(stored, entry["zstd_frames"], entry["chunk_bytes"], dtype.itemsize, data,
                 f"tensor {path!r} in {directory / entry['file']}")
    if zlib.crc32(memoryview(data.numpy())) != entry["crc32"]:
        raise ValueError(f"state_files: tensor {path!r} in {directory / entry['file']} fails its CRC32 (corrupted)")
    return data.view(dtype).view(entry["shape"])


def _fill(directory: Path, entries: list[dict], item: _Item) -> None:
    """Copy into `item`'s local shard the rows it needs from whichever saved ranks (`entries`) hold them."""
    path, leaf, local, row = item
    if entries[0]["global_shape"] != list(leaf.shape):
        raise ValueError(f"state_files: tensor {path!r} is {entries[0]['global_shape']} in {directory}, "
                         f"{list(leaf.shape)} here")
    if entries[0]["row"] is None:  # saved whole (not sharded): any saved rank's copy will do
        whole = _read(directory, entries[0], path)
        local.copy_(whole if row is None else whole[row:row + local.shape[0]])
        return
    lo = row or 0  # a whole target (row None) takes every row
    hi, copied = lo + local.shape[0], 0
    for entry in entries:
        first, end = max(lo, entry["row"]), min(hi, entry["row"] + entry["shape"][0])
        if first < end:
            local[first - lo:end - lo].copy_(_read(directory, entry, path)[first - entry["row"]:end - entry["row"]])
            copied += end - first
    if copied != hi - lo:
        raise ValueError(f"state_files: {directory} holds {copied} of rows {lo}..{hi} of tensor {path!r} "
                         "(a rank's index or files are missing)")


def _unplane(stored: torch.Tensor, frames: list[int], chunk_bytes: int, esize: int, out: torch.Tensor, what: str
             ) -> None:  # fmt: skip
    """Undo the zstd byte planes of `save_state`, chunk by chunk, from `stored` into `out` (logical bytes)."""
    import numpy
    import zstandard

    decompressor, pos = zstandard.ZstdDecompressor(), 0
    for k, frame in enumerate(frames):
        chunk = out[k * chunk_bytes:(k + 1) * chunk_bytes]
        n = chunk.numel() // esize
        planes = torch.empty(esize, n, dtype=torch.uint8)
        try:
            top = decompressor.decompress(memoryview(stored[pos:pos + frame].numpy()), max_output_size=n)
        except zstandard.ZstdError as e:
            raise ValueError(f"state_files: {what} cannot be decompressed (corrupted): {e}") from None
        if len(top) != n:
            raise ValueError(f"state_files: {what} decompresses to {len(top)} bytes, not {n} (corrupted)")
        planes[-1].numpy()[:] = numpy.frombuffer(top, dtype=numpy.uint8)
        pos += frame
        planes[:-1].view(-1).copy_(stored[pos:pos + (esize - 1) * n])
        pos += (esize - 1) * n
        elements = chunk.view(n, esize)
        for j in range(esize):
            elements[:, j].copy_(planes[j])


def _replace_objects(tree: Any, objects: dict[str, Any], prefix: str = "") -> Any:
    if isinstance(tree, dict):
        return {k: _replace_objects(v, objects, f"{prefix}/{k}" if prefix else str(k)) for k, v in tree.items()}
    return objects.get(prefix, tree) if not torch.is_tensor(tree) else tree
