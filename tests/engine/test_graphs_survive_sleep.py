"""Decode graphs outlive sleep and wake: the weights and the KV pool keep their addresses (arena.py), so
the engine records each decode bucket once, not again after every wake.

CPU has no CUDA graphs. The engine's capture seam (`HFEngine(graph_capture=...)`) takes
`AddressCheckedCapture` instead: it counts recordings, remembers the addresses of every weight and KV
tensor a recorded step reads, and refuses a replay once any of them moved (where a CUDA graph would read
freed memory). What this shows on CPU: the engine logic (graphs kept, the same addresses after sleep and
wake, the arena's pages given back while asleep, results unchanged). What it cannot show: the CUDA
driver's virtual-memory calls; tests/engine/test_hf_engine_gpu.py runs those on a GPU.
"""

from __future__ import annotations

import asyncio
import mmap
import struct
from collections.abc import Callable

import pytest
import torch
from model_helpers import random_qwen2

from verl_agent.engine.runner import arena, model_runner
from verl_agent.engine.contract import SamplingParams
from verl_agent.engine.backends.hf_engine import HFEngine

PROMPTS = [[5 + i + j for j in range(1 + i % 4)] for i in range(10)]  # 10 rows: buckets of 16, then 8 rows
SP = [SamplingParams(temperature=1.0, max_new_tokens=3 + i, seed=i) for i in range(len(PROMPTS))]


class AddressCheckedCapture:
    """A stand-in for CUDA-graph capture (see the module docstring)."""

    def __init__(self) -> None:
        self.engine: HFEngine | None = None
        self.recorded = 0

    def addresses(self) -> list[int]:
        assert self.engine is not None
        pool = self.engine._batcher.runner.pool
        assert pool is not None
        return [p.data_ptr() for p in self.engine.model.parameters()] + [t.data_ptr() for t in (*pool.k, *pool.v)]

    def __call__(self, step: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        self.recorded += 1
        at, out = self.addresses(), step()

        def replay() -> None:
            if self.addresses() != at:
                raise AssertionError("a recorded step replayed over tensors that moved")
            with self.engine._batcher.runner.running():  # a CUDA graph replays kernels, not Python
                out.copy_(step())

        return replay, out


def resident_pages(t: torch.Tensor) -> int:
    """Pages of tensor `t`'s memory that are in RAM now (bit 63 of each page's /proc/self/pagemap entry)."""
    page = mmap.PAGESIZE
    first, last = t.data_ptr() // page, (t.data_ptr() + t.numel() * t.element_size() - 1) // page
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(first * 8)
        entries = f.read((last - first + 1) * 8)
    return sum(e >> 63 for (e,) in struct.iter_unpack("<Q", entries))


async def batch(engine: HFEngine):
    return await asyncio.gather(*(engine.generate(p, s) for p, s in zip(PROMPTS, SP)))


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed-addresses", "driver-refuses"])
async def test_graphs_are_recorded_once_across_sleep_and_wake(fixed, monkeypatch):
    """fixed: the trainer's sleep (discard the weights, load them back) and the keeping sleep leave the graph
    count where the first round put it, free the arenas' pages meanwhile, and sample what an eager engine
    samples. driver-refuses (no fixed-address memory): the graphs go with the sleep and are recorded again,
    which is what the counter would show if the addresses moved."""
    if not fixed:
        monkeypatch.setattr(model_runner, "make_arena", lambda *a: None)
        monkeypatch.setattr(arena.ParamArena, "adopt", classmethod(lambda cls, *a: None))
    model = random_qwen2(seed=3)
    saved = [(k, v.clone()) for k, v in model.state_dict().items() if k != "lm_head.weight"]  # tied
    eager = await batch(e0 := HFEngine(random_qwen2(seed=3), stop_on_eos=False, max_model_len=128))
    await e0.close()
    cap = AddressCheckedCapture()
    engine = cap.engine = HFEngine(model, stop_on_eos=False, max_model_len=128, graph_capture=cap)
    first = await batch(engine)
    recorded = engine.metrics()["engine/graph_captures"]
    assert recorded == cap.recorded >= 2  # more than one rows bucket as rows finish
    for a, b in zip(first, eager):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    kv = engine._batcher.runner.pool.k[0]
    for rnd, discard in enumerate((True, False), start=1):
        await engine.sleep(discard_weights=discard)
        if fixed:
            assert resident_pages(kv) == 0  # the KV arena's pages went back to the kernel
            if discard:
                assert resident_pages(engine._params.arena.storage) == 0  # and the weights' pages
        await engine.wake_up()
        if discard:
            await engine.update_weights(saved)
        again = await batch(engine)
        assert [o.token_ids for o in again] == [o.token_ids for o in first]
        for a, b in zip(again, first):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-6, rtol=0)
        assert engine.metrics()["engine/graph_captures"] == recorded * (1 if fixed else 1 + rnd)
    assert engine.metrics()["engine/graph_captures"] == cap.recorded
    await engine.close()


async def test_borrowed_weights_stay_put_through_sleep_and_their_graphs_with_them():
    """A model whose parameters are another model's tensors (the trainer's, trainer/weights/shared_weights.py):
    no weight arena copies them, either sleep frees the KV arena alone (the parameters keep their tensors,
    asked to discard or not), and the graphs recorded over them replay after the wake."""
    from verl_agent.engine.backends.hf_engine import BORROWED_WEIGHTS

    model = random_qwen2(seed=3)
    setattr(model, BORROWED_WEIGHTS, True)
    def tensors() -> list[tuple[int, torch.Size]]:
        return [(p.data_ptr(), p.shape) for p in model.parameters()]

    owned = tensors()
    cap = AddressCheckedCapture()
    engine = cap.engine = HFEngine(model, stop_on_eos=False, max_model_len=128, graph_capture=cap)
    assert engine._params is None
    first = await batch(engine)
    recorded = engine.metrics()["engine/graph_captures"]
    kv = engine._batcher.runner.pool.k[0]
    for discard in (True, False):
        await engine.sleep(discard_weights=discard)
        assert resident_pages(kv) == 0
        assert tensors() == owned
        await engine.wake_up()
        again = await batch(engine)  # no update_weights: nothing was discarded
        assert [o.token_ids for o in again] == [o.token_ids for o in first]
    assert engine.metrics()["engine/graph_captures"] == recorded == cap.recorded
    await engine.close()


def test_an_arena_keeps_its_addresses_and_gives_its_pages_back():
    """The CPU arena: carved tensors keep their address across release/commit; release frees the pages and
    they read as zeros afterwards; carving past the end is refused with the sizes."""
    a = arena.Arena(1 << 20, torch.device("cpu"))
    x = a.carve((1000,), torch.float32)
    y = a.carve((3, 5), torch.bfloat16)
    assert y.data_ptr() - x.data_ptr() == 4096 and y.data_ptr() % arena.ALIGN == 0
    x.fill_(2.0)
    assert resident_pages(x) == 1
    ptr = x.data_ptr()
    a.release()
    assert resident_pages(x) == 0 and not a.committed
    a.commit()
    assert x.data_ptr() == ptr and float(x.abs().sum()) == 0.0
    with pytest.raises(arena.ArenaError, match="no room for 4194304 more"):
        a.carve((1 << 20,), torch.float32)


def test_a_cuda_runner_without_a_given_capture_records_graphs_each_drop_in_a_new_pool(monkeypatch):
    """The production path (no capture seam, cuda_graphs on, a CUDA model): the runner records its decode steps,
    and dropping the graphs (LoRA adapters installed) moves it to a new private pool. The two CUDA calls are
    stand-ins here (no GPU); the model is a stand-in whose only parameter says it lives on CUDA."""
    from types import SimpleNamespace

    pools = iter(range(100))
    monkeypatch.setattr(model_runner.torch.cuda, "graph_pool_handle", lambda: next(pools))
    monkeypatch.setattr(model_runner, "cuda_graph_capture", lambda pool: f"capture into pool {pool}")
    param = SimpleNamespace(device=torch.device("cuda"), dtype=torch.bfloat16)
    model = SimpleNamespace(parameters=lambda: iter([param]), modules=lambda: iter([]))
    runner = model_runner.ModelRunner(model, budget=None, pad_id=0, cache_kw="past_key_values", cuda_graphs=True)
    assert runner.cuda_graphs and runner.capture == "capture into pool 0"
    runner.drop_graphs("a test")
    assert runner.cuda_graphs and runner.capture == "capture into pool 1" and runner.graphs == {}
    off = model_runner.ModelRunner(model, budget=None, pad_id=0, cache_kw="past_key_values", cuda_graphs=False)
    assert not off.cuda_graphs and off.capture is None


async def test_engines_over_one_model_are_created_and_closed_repeatedly(monkeypatch):
    """What eval (a column per model), tests and notebooks do: engines built one after another over one model
    object (bench/rollout.py's continuous, unfused and compiled rows), with recorded decode steps, fused
    norms on and off, and a compiled step (dynamo's eager backend:
    its tracing, guards and recompiles across engines, without Inductor's C++ builds). Each engine moves the
    weights into an arena of its own and records its own steps (a replay over moved tensors raises); every
    one samples what an eager engine samples; a closed engine's KV memory goes at once, and each weight arena
    as soon as the weights moved on (nothing accumulates)."""
    import functools
    import gc
    import weakref

    monkeypatch.setattr(model_runner.torch, "compile", functools.partial(torch.compile, backend="eager"))
    prompts, sp = PROMPTS[:3], SP[:3]
    model = random_qwen2(seed=3)
    e0 = HFEngine(random_qwen2(seed=3), stop_on_eos=False, max_model_len=64)
    eager = await asyncio.gather(*(e0.generate(p, s) for p, s in zip(prompts, sp)))
    await e0.close()
    kv_memory, weight_memory = [], []  # the arenas' mmaps: alive while any tensor over them is
    for compiled, fused in ((False, True), (False, False), (True, True)):  # bench/rollout.py's three rows
        cap = AddressCheckedCapture()
        engine = cap.engine = HFEngine(model, stop_on_eos=False, max_model_len=64, graph_capture=cap,
                                       torch_compile=compiled, fused_norms=fused)  # fmt: skip
        out = await asyncio.gather(*(engine.generate(p, s) for p, s in zip(prompts, sp)))
        assert [o.token_ids for o in out] == [o.token_ids for o in eager], (compiled, fused)
        for a, b in zip(out, eager):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
        assert engine.metrics()["engine/graph_captures"] == cap.recorded >= 1
        kv_memory.append(weakref.ref(engine._batcher.runner.pool.arena._mm))
        weight_memory.append(weakref.ref(engine._params.arena._mm))
        await engine.close()
        del engine, cap
        gc.collect()
        assert kv_memory[-1]() is None  # the closed engine's KV memory went with it
    # the weights live in the last engine's arena (the model still uses them); the earlier ones are gone
    assert [r() is None for r in weight_memory] == [True] * 2 + [False]


def test_a_cuda_arena_is_unmapped_only_after_the_device_finished_its_queued_work(monkeypatch):
    """The free behind the third engine's illegal memory access (bench/rollout.py, three engines over one
    model): the weights' copies into the new arena were still queued when the last tensor over the old one
    went, and its memory was unmapped at once. The driver calls are recorded here (no GPU): a synchronize comes
    first; during a graph capture on this thread (where a synchronize would break the capture) the free waits
    for the next arena call."""
    calls = []
    monkeypatch.setattr(arena, "_cu", lambda name, *args: calls.append(name))
    monkeypatch.setattr(arena.torch.cuda, "synchronize", lambda device=None: calls.append(f"synchronize {device}"))
    capturing = [False]
    monkeypatch.setattr(arena.torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    rng = arena._CudaRange(1 << 40, 1 << 21, [7], 0)
    del rng  # the last tensor over the range went
    assert calls == ["synchronize 0", "cuMemUnmap", "cuMemRelease", "cuMemAddressFree"]
    calls.clear()
    capturing[0] = True
    rng = arena._CudaRange(1 << 40, 1 << 21, [7], 1)
    del rng
    assert calls == [] and arena.free_deferred() == 0  # still capturing: nothing yet
    capturing[0] = False
    assert arena.free_deferred() == 1
    assert calls == ["synchronize 1", "cuMemUnmap", "cuMemRelease", "cuMemAddressFree"]
