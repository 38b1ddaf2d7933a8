"""Contiguous shards of a batch over ranks or rollout workers (rank i gets shard i)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

__all__ = ["shard_list", "shard_sizes"]

T = TypeVar("T")


def shard_sizes(n: int, k: int) -> list[int]:
    """Sizes of `k` shards of `n` items, differing by at most one (the larger ones first)."""
    q, r = divmod(n, k)
    return [q + (1 if i < r else 0) for i in range(k)]


def shard_list(items: Sequence[T], k: int) -> list[list[T]]:
    """Contiguous shards, sizes differing by at most one (rank i gets shard i)."""
    out, start = [], 0
    for size in shard_sizes(len(items), k):
        out.append(list(items[start:start + size]))
        start += size
    return out

