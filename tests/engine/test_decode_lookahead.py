"""The decode lookahead (engine/continuous.py): the next decode step is launched from the last step's tokens on
the device before they are recorded. On CPU everything runs synchronously, so what these tests check is that
the lookahead changes no result (the same tokens and log-probs as one step at a time) and its bookkeeping
(steps launched ahead, rows wasted on requests that ended, nothing in flight once the engine is idle)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
import torch
from model_helpers import random_qwen2, wait_for

from verl_agent.engine.backends.hf_engine import HFEngine
from verl_agent.engine.contract import GenerateOutput, SamplingParams

STOPS = list(range(40, 52))  # the random model samples nearly uniformly: about 1 token in 8 ends a request


def sp(seed: int, n: int, stops: bool = True) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_new_tokens=n, seed=seed, stop_token_ids=STOPS if stops else [])


class ReplayCapture:
    """A CPU stand-in for CUDA-graph capture: a replay runs the recorded step again into the same output,
    reading the runner's static input buffer as a graph does."""

    def __init__(self) -> None:
        self.engine: HFEngine | None = None

    def __call__(self, step: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        out = step()

        def replay() -> None:
            assert self.engine is not None
            with self.engine._batcher.runner.running():
                out.copy_(step())

        return replay, out


def make_engine(lookahead: bool, graphs: bool = False, **kw) -> HFEngine:
    capture = ReplayCapture() if graphs else None
    e = HFEngine(random_qwen2(seed=2), stop_on_eos=False, max_model_len=128, decode_lookahead=lookahead,
                 graph_capture=capture, **kw)  # fmt: skip
    if capture is not None:
        capture.engine = e
    return e


async def idle(e: HFEngine) -> None:
    """Wait until the engine loop has returned (a request's result can arrive while a step is still in flight)."""
    await wait_for(lambda: not e._batcher._serving)
    assert e._batcher._inflight is None


async def submit(e: HFEngine, prompt: list[int], sampling: SamplingParams, **kw) -> asyncio.Future:
    """Queue one request and wait until its prompt is prefilled, alone in its chunk: a chunk's rows are padded
    to a common width, so a prompt prefilled with others may differ in the last bits of its K/V."""
    n = e.metrics()["engine/prefill_chunks"]
    call = asyncio.ensure_future(e.generate(prompt, sampling, **kw))
    await wait_for(lambda: e.metrics()["engine/prefill_chunks"] > n)
    return call


async def workload(lookahead: bool, graphs: bool) -> tuple[dict[str, GenerateOutput], dict[str, float]]:
    """Seeded requests of different lengths, some ending on a stop token, each arriving while the earlier ones
    decode; a two-turn session (the second turn reuses the first one's KV); a request cancelled
    mid-generation. At most 8 requests at once, in 8 slots: the session's slot is never evicted."""
    e = make_engine(lookahead, graphs, max_num_seqs=8)
    calls = {f"a{i}": await submit(e, [5 + i, 6, 7], sp(i, 4 + 12 * i, stops=i > 0)) for i in range(4)}
    tokens: list[int] = []
    doomed = await submit(e, [9, 9], sp(99, 100, stops=False), on_token=lambda t, _: tokens.append(t))
    turn1 = await submit(e, [30, 31, 32], sp(100, 12), session="traj")
    calls |= {f"b{i}": await submit(e, [20 + i], sp(10 + i, 15)) for i in range(2)}
    await wait_for(lambda: len(tokens) >= 8)
    doomed.cancel()
    outs = {"s.1": await turn1}
    calls["s.2"] = await submit(e, [30, 31, 32] + outs["s.1"].token_ids + [60, 61], sp(101, 12), session="traj")
    outs |= {k: await c for k, c in calls.items()}
    with pytest.raises(asyncio.CancelledError):
        await doomed
    await wait_for(lambda: e.metrics()["engine/requests"] == 9)  # the cancelled one ends at its next step
    await idle(e)
    m = e.metrics()
    await e.close()
    return outs, m


@pytest.mark.parametrize("graphs", [True, False], ids=["replayed", "eager"])
async def test_the_lookahead_samples_what_one_step_at_a_time_samples(graphs):
    """replayed: decode steps of fixed shapes (8 rows, 128 columns, as with CUDA graphs), so every row's
    numbers are bit for bit the same. eager: CPU steps fit rows and columns to the batch at hand, whose
    makeup depends on timing (and on the lookahead: a row that ended stays in one more step), which moves
    the last bits of log-probs, as it does between two runs without the lookahead."""
    ahead, m = await workload(True, graphs)
    plain, m0 = await workload(False, graphs)
    for k, out in plain.items():
        assert ahead[k].token_ids == out.token_ids, k
        assert ahead[k].finish_reason == out.finish_reason, k
        if graphs:
            assert ahead[k].logprobs == out.logprobs, k
        else:
            assert ahead[k].logprobs == pytest.approx(out.logprobs, abs=1e-5), k
    reasons = [o.finish_reason for o in plain.values()]
    assert "stop" in reasons and "length" in reasons  # the workload has both kinds of ending
    assert m["engine/prefill_tokens_saved"] == m0["engine/prefill_tokens_saved"] > 0  # the session reused KV
    assert m["engine/decode_lookahead_steps"] > 0 and m["engine/decode_wasted_rows"] > 0
    assert m0["engine/decode_lookahead_steps"] == m0["engine/decode_wasted_rows"] == 0
    assert m["engine/busy_s"] == pytest.approx(m["engine/prefill_s"] + m["engine/decode_s"])


async def stop_seed(n_min: int) -> tuple[int, GenerateOutput]:
    """A seed whose request ends on a stop token after at least `n_min` tokens (found one step at a time)."""
    e = make_engine(False)
    for seed in range(200):
        out = await e.generate([5, 6, 7], sp(seed, 64))
        if out.finish_reason == "stop" and len(out.token_ids) >= n_min:
            await e.close()
            return seed, out
    raise AssertionError("no seed ends on a stop token")


async def test_steps_launched_ahead_and_wasted_are_counted():
    """One request decoding alone: every step after the first is launched ahead; ending on a stop token
    wastes the one step launched after it, ending by length wastes none (the last step is known)."""
    seed, ref = await stop_seed(5)
    n = len(ref.token_ids)  # the first from the prefill, n - 1 from decode steps
    e = make_engine(True)
    out = await e.generate([5, 6, 7], sp(seed, 64))
    assert out.token_ids == ref.token_ids and out.finish_reason == "stop"
    await idle(e)
    m = e.metrics()
    assert m["engine/decode_rows"] == n - 1 and m["engine/decode_steps"] == n
    assert m["engine/decode_lookahead_steps"] == n - 1 and m["engine/decode_wasted_rows"] == 1

    before = e.metrics()
    out = await e.generate([5, 6, 7], sp(seed, n - 1))  # ends by length one token before its stop token
    assert out.token_ids == ref.token_ids[:-1] and out.finish_reason == "length"
    await idle(e)
    d = {k: v - before[k] for k, v in e.metrics().items()}
    assert d["engine/decode_rows"] == d["engine/decode_steps"] == n - 2
    assert d["engine/decode_lookahead_steps"] == n - 3 and d["engine/decode_wasted_rows"] == 0
    await e.close()


async def test_an_interrupt_sees_no_step_in_flight():
    """The tokens an interrupted request returns are a prefix of its uninterrupted output: the step launched
    ahead of the interrupt is recorded before it, the one after is never launched."""
    full = await (e0 := make_engine(False)).generate([5, 6], sp(3, 120, stops=False))
    await e0.close()
    e = make_engine(True)
    call = asyncio.ensure_future(e.generate([5, 6], sp(3, 120, stops=False)))
    await wait_for(lambda: e.metrics()["engine/decode_lookahead_steps"] >= 5)
    assert await e.interrupt()
    out = await call
    k = len(out.token_ids)
    assert out.finish_reason == "abort" and 5 < k < 120
    assert out.token_ids == full.token_ids[:k] and out.logprobs == full.logprobs[:k]
    await idle(e)
    assert e.metrics()["engine/decode_wasted_rows"] == 0
    await e.close()
