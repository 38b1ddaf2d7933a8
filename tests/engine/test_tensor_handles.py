"""Tensors passed to another process by handle (verl_agent/engine/tensor_handles.py): a real spawned process
maps the sender's shared memory, reads exact values of every dtype, and a reused staging buffer carries
the next bucket. CUDA IPC needs a GPU and is not exercised here."""

from __future__ import annotations

import multiprocessing as mp

import torch

from verl_agent.engine.tensor_handles import HandleStaging, dumps_by_handle, memory_key
from verl_agent.trainer.workers.controller import weight_routes


def _read_in_child(blob: bytes, out) -> None:
    from verl_agent.engine.tensor_handles import loads_by_handle, memory_key

    bucket = loads_by_handle(blob)  # values go back as lists: the queue must not share memory itself
    out.put(([(n, str(t.dtype), list(t.shape), t.float().flatten().tolist()) for n, t in bucket],
             memory_key(torch.device("cpu"))))


def _round_trip(blob: bytes):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_read_in_child, args=(blob, out))
    child.start()
    try:
        return out.get(timeout=60)
    finally:
        child.join(timeout=30)


def test_a_staged_bucket_reaches_another_process_exactly_and_the_buffer_is_reused():
    torch.manual_seed(0)
    bucket = [("w", torch.randn(64, 33)), ("b", torch.randn(7).to(torch.bfloat16)), ("i", torch.arange(5)),
              ("t", torch.randn(8, 8).t())]  # odd sizes, three dtypes, a non-contiguous view
    staging = HandleStaging()
    assert staging.fits(bucket)
    blob = dumps_by_handle(staging.pack(bucket))
    assert len(blob) < 4096  # handles, not the 10 KB of values
    got, child_key = _round_trip(blob)
    assert [(n, d, s) for n, d, s, _ in got] == [(n, str(t.dtype), list(t.shape)) for n, t in bucket]
    for (_, _, _, values), (_, t) in zip(got, bucket):
        assert values == t.float().flatten().tolist()
    assert child_key == memory_key(torch.device("cpu"))  # same host: the trainer would pick handles
    buf = staging.buf
    second = [("w", torch.full((10, 3), 2.5))]
    got, _ = _round_trip(dumps_by_handle(staging.pack(second)))
    assert staging.buf is buf  # the smaller bucket went into the same shared buffer
    assert got[0][3] == [2.5] * 30


def test_a_bucket_larger_than_dev_shm_does_not_fit():
    huge = [("w", torch.empty(1 << 40, dtype=torch.uint8, device="meta"))]  # 1 TB, allocates nothing
    assert not HandleStaging().fits(huge)


def test_weights_go_by_handle_only_where_the_memory_keys_match_and_transport_is_auto():
    rank0 = {"memory": "host/boot/cpu"}
    infos = [{"memory": "host/boot/cpu"}, {"memory": "other/boot/cpu"}]
    assert weight_routes("auto", rank0, infos) == ["handle", "collective"]
    assert weight_routes("collective", rank0, infos) == ["collective", "collective"]
    assert weight_routes("object_store", rank0, infos) == ["object_store", "object_store"]
