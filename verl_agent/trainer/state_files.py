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
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

__all__ = ["save_state", "load_state"]

STAGING_BYTES = 256 << 20
INDEX = "rank{}.json"
OBJECTS = "objects.pt"


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


def save_state(directory: Path, state: dict, rank: int, world_size: int, threads: int = 8) -> None:
    """Write this rank's tensors of `state` (nested dicts; DTensor or plain leaves) into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    tensors, objects, aliases, seen = [], {}, {}, {}
    for path, leaf in _flatten(state):
        if torch.is_tensor(leaf):
            local, row = _local(leaf)
            key = (local.data_ptr(), local.dtype, tuple(local.shape), local.stride()) if local.numel() else None
            if key is not None and key in seen:  # tied weights (embeddings = LM head) appear under two names: write the bytes once
                aliases[path] = seen[key]
                continue
            seen[key] = path
            tensors.append((path, leaf, local, row))
        else:
            objects[path] = leaf
    if rank == 0:
        torch.save(objects, directory / OBJECTS)
    load = [0] * threads  # bytes per file: largest tensors first, each to the least loaded file
    files: list[list[tuple[str, Any, torch.Tensor, int | None]]] = [[] for _ in range(threads)]
    for item in sorted(tensors, key=lambda x: -x[2].nbytes):
        i = load.index(min(load))
        files[i].append(item)
        load[i] += item[2].nbytes

    def write(i: int) -> dict[str, dict]:
        name, index = f"rank{rank}_{i}.bin", {}
        cuda = any(local.is_cuda for _, _, local, _ in files[i])
        stream = torch.cuda.Stream() if cuda else None
        buf = torch.empty(STAGING_BYTES, dtype=torch.uint8, pin_memory=True) if cuda else None
        with open(directory / name, "wb") as f:
            for path, leaf, local, row in files[i]:
                flat, crc, offset = _as_bytes(local), 0, f.tell()
                for start in range(0, flat.numel(), STAGING_BYTES):
                    part = flat[start:start + STAGING_BYTES]
                    if part.is_cuda:
                        with torch.cuda.stream(stream):
                            buf[:part.numel()].copy_(part, non_blocking=True)
                        stream.synchronize()
                        part = buf[:part.numel()]
                    view = memoryview(part.numpy())
                    crc = zlib.crc32(view, crc)
                    f.write(view)
                index[path] = {"file": name, "offset": offset, "nbytes": flat.numel(), "dtype": str(local.dtype),
                               "shape": list(local.shape), "global_shape": list(leaf.shape), "row": row,
                               "crc32": crc}  # fmt: skip
            f.flush()
            os.fsync(f.fileno())
        return index

    if any(local.is_cuda for _, _, local, _ in tensors):
        torch.cuda.synchronize()  # the optimizer's last kernels wrote these tensors on the default stream
    with ThreadPoolExecutor(threads) as pool:
        index = {k: v for part in pool.map(write, range(threads)) for k, v in part.items()}
    index.update({path: index[original] for path, original in aliases.items()})
    meta = {"format": 1, "rank": rank, "world_size": world_size, "tensors": index}
    (directory / INDEX.format(rank)).write_text(json.dumps(meta))


def load_state(directory: Path, state: dict, threads: int = 8) -> dict:
    """Fill the tensors of `state` (this rank's current shards) in place from `directory`; returns `state`
    with its non-tensor leaves replaced by the saved ones."""
    saved = [json.loads(p.read_text()) for p in sorted(directory.glob(INDEX.format("*")))]
    if not saved:
        raise FileNotFoundError(f"state_files: no {INDEX.format('*')} index in {directory}")
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

    def read(entry: dict, path: str) -> torch.Tensor:
        data = torch.empty(entry["nbytes"], dtype=torch.uint8)
        with open(directory / entry["file"], "rb") as f:
            f.seek(entry["offset"])
            if f.readinto(memoryview(data.numpy())) != entry["nbytes"]:
                raise ValueError(f"state_files: {entry['file']} ends inside tensor {path!r} (truncated)")
        if zlib.crc32(memoryview(data.numpy())) != entry["crc32"]:
            raise ValueError(f"state_files: tensor {path!r} in {directory / entry['file']} fails its CRC32 (corrupted)")
        return data.view(getattr(torch, entry["dtype"].removeprefix("torch."))).view(entry["shape"])

    def fill(item: tuple[str, Any, torch.Tensor, int | None]) -> None:
        path, leaf, local, row = item
        entries = by_path[path]
        if entries[0]["global_shape"] != list(leaf.shape):
            raise ValueError(f"state_files: tensor {path!r} is {entries[0]['global_shape']} in {directory}, "
                             f"{list(leaf.shape)} here")
        if entries[0]["row"] is None:  # saved whole (not sharded): any saved rank's copy will do
            whole = read(entries[0], path)
            local.copy_(whole if row is None else whole[row:row + local.shape[0]])
            return
        lo = row or 0  # a whole target (row None) takes every row
        hi, copied = lo + local.shape[0], 0
        for entry in entries:
            a, b = max(lo, entry["row"]), min(hi, entry["row"] + entry["shape"][0])
            if a < b:
                local[a - lo:b - lo].copy_(read(entry, path)[a - entry["row"]:b - entry["row"]])
                copied += b - a
        if copied != hi - lo:
            raise ValueError(f"state_files: {directory} holds {copied} of rows {lo}..{hi} of tensor {path!r} "
                             "(a rank's index or files are missing)")

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(fill, sorted(targets, key=lambda x: -x[2].nbytes)))
    if any(local.is_cuda for _, _, local, _ in targets):
        torch.cuda.synchronize()
    return _replace_objects(state, objects)


def _replace_objects(tree: Any, objects: dict[str, Any], prefix: str = "") -> Any:
    if isinstance(tree, dict):
        return {k: _replace_objects(v, objects, f"{prefix}/{k}" if prefix else str(k)) for k, v in tree.items()}
    return objects.get(prefix, tree) if not torch.is_tensor(tree) else tree
