"""HFEngine's continuous scheduler on CPU: joining mid-batch, per-session KV reuse, limits and memory budget."""

from __future__ import annotations

import asyncio

import pytest
import torch

from verl_agent.engine.contract import SamplingParams
from verl_agent.engine.backends.hf_engine import HFEngine, KVCacheOverflowError
from verl_agent.engine.runner.kv_pool import kv_bytes_per_token
from verl_agent.engine.slots import SlotTable
from model_helpers import wait_for

PROMPT = [5, 6, 7, 8, 9, 10, 11]
TOOL = [40, 41, 42, 43, 44]  # "tool output" appended between turns


def engine(model, **kw) -> HFEngine:
    return HFEngine(model, stop_on_eos=False, max_model_len=kw.pop("max_model_len", 128), **kw)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_a_request_joining_mid_batch_gets_what_it_gets_alone(small_model, temperature):
    sp = SamplingParams(temperature=temperature, max_new_tokens=12, seed=7)
    alone = await (e0 := engine(small_model)).generate(PROMPT, sp)
    await e0.close()
    e = engine(small_model)
    long = asyncio.ensure_future(e.generate([3, 4], SamplingParams(temperature=1.0, max_new_tokens=100, seed=1)))
    await wait_for(lambda: e.metrics()["engine/decode_steps"] >= 5)
    joined = await e.generate(PROMPT, sp)
    assert not long.done()  # it really joined a running batch
    assert joined.token_ids == alone.token_ids
    assert joined.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    assert len((await long).token_ids) == 100
    await e.close()


async def turns(e: HFEngine, sp: SamplingParams, session: str | None, n: int = 3):
    """n turns of one trajectory; each prompt = previous prompt + response + tool tokens."""
    prompt, outs = list(PROMPT), []
    for _ in range(n):
        out = await e.generate(prompt, sp, session=session)
        outs.append(out)
        prompt = prompt + out.token_ids + TOOL
    return outs


@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_kv_reuse_equals_a_full_prefill(small_model, temperature):
    sp = SamplingParams(temperature=temperature, max_new_tokens=9, seed=11)
    full, reuse = engine(small_model), engine(small_model)
    ref = await turns(full, sp, session=None)
    got = await turns(reuse, sp, session="traj-0")
    for a, b in zip(ref, got):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-5, rtol=0)
    m_full, m = full.metrics(), reuse.metrics()
    # turn 2 reuses prompt + response minus the last sampled token; turn 3 likewise
    saved = (len(PROMPT) + 9 - 1) + (len(PROMPT) + 9 + len(TOOL) + 9 - 1)
    assert m["engine/prefill_tokens_saved"] == saved and m["engine/sessions_reused"] == 2
    assert m["engine/prefill_tokens"] == m_full["engine/prefill_tokens"] - saved
    assert m_full["engine/prefill_tokens_saved"] == 0
    await reuse.release_session("traj-0")
    await wait_for(lambda: reuse.metrics()["engine/sessions_idle"] == 0)
    await full.close()
    await reuse.close()


async def test_a_session_that_rewrites_its_history_keeps_only_the_shared_prefix(small_model):
    sp = SamplingParams(temperature=0.0, max_new_tokens=6)
    e, fresh = engine(small_model), engine(small_model)
    first = await e.generate(PROMPT, sp, session="s")
    assert first.token_ids[-2] != 60
    edited = PROMPT + first.token_ids[:-2] + [60] + TOOL  # history rewritten (e.g. a context strategy)
    got = await e.generate(edited, sp, session="s")
    want = await fresh.generate(edited, sp)
    assert got.token_ids == want.token_ids
    torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5, rtol=0)
    m, shared = e.metrics(), len(PROMPT) + 4  # PROMPT + first[:-2]: their K/V stay; the rest is prefilled
    assert m["engine/sessions_reset"] == 1 and m["engine/prefill_tokens_saved"] == shared
    assert m["engine/prefill_tokens"] == len(PROMPT) + len(edited) - shared
    # the session now holds the new history, and a turn extending it is reused again
    await e.generate(edited + got.token_ids + TOOL, sp, session="s")
    assert e.metrics()["engine/prefill_tokens_saved"] == shared + len(edited) + 6 - 1
    # a prompt that shares nothing (a new first token) prefills everything
    before = e.metrics()["engine/prefill_tokens"]
    await e.generate([PROMPT[0] + 1, *PROMPT[1:]], sp, session="s")
    assert e.metrics()["engine/prefill_tokens"] - before == len(PROMPT)
    await e.close()
    await fresh.close()


async def test_memory_budget_overflow_fails_one_request_and_no_other(small_model):
    bpt = kv_bytes_per_token(small_model.config, torch.float32)
    e = HFEngine(small_model, stop_on_eos=False, max_num_seqs=4, max_model_len=32, kv_cache_bytes=4 * 33 * bpt)
    assert (e.metrics()["engine/kv_slots"], e.metrics()["engine/kv_tokens_per_slot"]) == (4, 32)
    fewer = HFEngine(small_model, max_num_seqs=4, max_model_len=64, kv_cache_bytes=4 * 33 * bpt)
    assert (fewer.metrics()["engine/kv_slots"], fewer.metrics()["engine/kv_tokens_per_slot"]) == (2, 64)
    sp = SamplingParams(temperature=0.0, max_new_tokens=8)
    reqs = [PROMPT, list(range(2, 42)), [9, 10, 11], list(range(3, 31))]  # the 40-token prompt cannot fit
    outs = await asyncio.gather(*(e.generate(p, sp) for p in reqs), return_exceptions=True)
    assert isinstance(outs[1], KVCacheOverflowError)
    assert "40 tokens" in str(outs[1]) and "32 tokens" in str(outs[1]) and "gpu_memory_utilization" in str(outs[1])
    assert [len(o.token_ids) for o in (outs[0], outs[2])] == [8, 8]
    # 28 prompt tokens: the slot holds 4 more positions, so it stops early with "length"
    assert len(outs[3].token_ids) == 32 - 28 + 1 and outs[3].finish_reason == "length"
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        HFEngine(small_model, kv_cache_bytes=bpt)
    await e.close()


async def test_idle_sessions_are_evicted_least_recently_used(small_model):
    sp = SamplingParams(temperature=0.0, max_new_tokens=4)
    e = engine(small_model, max_num_seqs=2)
    a = await e.generate(PROMPT, sp, session="a")
    await e.generate([20, 21, 22], sp, session="b")
    await e.generate([30, 31], sp, session="b-other")  # no free slot: evicts "a", the least recently used
    assert e.metrics()["engine/sessions_evicted"] == 1
    saved = e.metrics()["engine/prefill_tokens_saved"]
    again = await e.generate(PROMPT + a.token_ids + TOOL, sp, session="a")  # re-prefilled, same answer
    assert e.metrics()["engine/prefill_tokens_saved"] == saved
    ref = await engine(small_model).generate(PROMPT + a.token_ids + TOOL, sp)
    assert again.token_ids == ref.token_ids
    await e.close()


async def test_long_prompts_are_prefilled_in_chunks(small_model):
    sp = SamplingParams(temperature=0.0, max_new_tokens=6)
    prompt = [(7 * i) % 90 + 2 for i in range(30)]
    whole, chunked = engine(small_model), engine(small_model, max_num_batched_tokens=8)
    a, b = await whole.generate(prompt, sp), await chunked.generate(prompt, sp)
    assert a.token_ids == b.token_ids
    assert b.logprobs == pytest.approx(a.logprobs, abs=1e-5)
    assert chunked.metrics()["engine/prefill_chunks"] == 4  # 8 + 8 + 8 + 6
    await whole.close()
    await chunked.close()


async def test_weight_update_drops_cached_sessions(small_model):
    sp = SamplingParams(temperature=0.0, max_new_tokens=4)
    e = engine(small_model)
    out = await e.generate(PROMPT, sp, session="s")
    await e.update_weights((k, v.clone()) for k, v in small_model.state_dict().items())
    await e.generate(PROMPT + out.token_ids, sp, session="s")
    assert e.metrics()["engine/prefill_tokens_saved"] == 0  # K/V of the old policy are not reused
    await e.close()


async def test_cancelled_request_frees_its_slot(small_model):
    e = engine(small_model, max_num_seqs=1)
    t = asyncio.ensure_future(e.generate(PROMPT, SamplingParams(max_new_tokens=100)))
    await wait_for(lambda: e.metrics()["engine/decode_steps"] >= 2)
    t.cancel()
    out = await e.generate([3, 4], SamplingParams(temperature=0.0, max_new_tokens=3))  # needs the only slot
    assert len(out.token_ids) == 3
    await e.close()


def test_slot_table_lru_and_release():
    t = SlotTable(2)
    s0, s1 = t.take_free(), t.take_free()
    assert (s0, s1) == (0, 1) and t.take_free() is None
    t.park("a", s0, [1, 2], 1)
    t.park("b", s1, [3], 0)
    assert t.claim_session("a").slot == 0 and "a" in t.busy_sessions
    t.park("a", 0, [1, 2, 3], 2)  # "a" is now the most recently used
    assert t.take_free() == 1 and t.evicted == 1  # evicts "b"
    assert t.release("a") and not t.release("a") and t.take_free() == 0


async def test_running_sequences_are_packed_into_the_lowest_slots(small_model):
    """Idle sessions keep K/V in low slots; a running sequence is swapped below them, and every session's
    K/V moves with it: later turns still reuse it and still equal a full prefill."""
    sp = SamplingParams(temperature=0.0, max_new_tokens=5)
    e, fresh = engine(small_model, max_num_seqs=8), engine(small_model)
    prompts = [[10 + i, 20 + i, 30 + i] for i in range(6)]
    firsts = await asyncio.gather(*(e.generate(p, sp, session=f"s{i}") for i, p in enumerate(prompts)))
    ctx = [p + o.token_ids + TOOL for p, o in zip(prompts, firsts)]
    for i in (5, 0, 3):  # one at a time: each runs alone, so it is moved to slot 0
        got = await e.generate(ctx[i], sp, session=f"s{i}")
        assert got.token_ids == (await fresh.generate(ctx[i], sp)).token_ids
    m = e.metrics()
    assert m["engine/slot_swaps"] >= 2 and m["engine/sessions_reused"] == 3
    await e.close()
    await fresh.close()


def test_prefill_chunks_stay_within_the_token_budget_and_cover_every_prompt():
    from verl_agent.engine.scheduler import Scheduler
    from verl_agent.engine.sequence import Seq, SeqState

    loop = asyncio.new_event_loop()
    sched = Scheduler(n_slots=3, max_num_batched_tokens=64)
    lengths = [10, 50, 30, 100, 5, 64]
    seqs = [Seq(list(range(n)), SamplingParams(), max_new=4, stops=frozenset(), future=loop.create_future(),
                loop=loop) for n in lengths]  # fmt: skip
    for s in seqs:
        sched.add(s)
    steps = 0
    while any(s.state is not SeqState.DECODE for s in seqs):
        chunks = sched.schedule_prefill()
        assert chunks and len(chunks) * max(b - a for _, a, b in chunks) <= 64
        for s, a, b in chunks:
            assert a == s.n_cached < b <= len(s.prompt)
            s.n_cached = b
            if b == len(s.prompt):
                s.state = SeqState.DECODE
                sched.finish(s)  # frees the slot for the next waiting prompt
        steps += 1
    assert steps <= 8 and [s.n_cached for s in seqs] == lengths
    loop.close()


def test_waiting_tokens_count_only_what_a_session_must_prefill():
    from verl_agent.engine.scheduler import Scheduler
    from verl_agent.engine.sequence import Seq

    loop = asyncio.new_event_loop()
    sched = Scheduler(n_slots=2, max_num_batched_tokens=64)

    def seq(prompt, session):
        return Seq(prompt, SamplingParams(), 4, frozenset(), loop.create_future(), loop, session=session)

    sched.table.park("s", sched.table.take_free(), [1, 2, 3, 4, 5], 4)  # K/V of 4 tokens kept for "s"
    sched.add(seq([1, 2, 3, 4, 5, 6, 7], "s"))  # extends: 3 tokens to prefill
    sched.add(seq([9, 9, 9], "s"))  # would not extend (estimated before the first one runs): 3
    sched.add(seq([8] * 10, None))
    assert sched.waiting_tokens == 3 + 3 + 10 == sched.ready_tokens()
    chunks = sched.schedule_prefill()
    assert [(a, b) for _, a, b in chunks] == [(4, 7), (0, 3)]  # the 2nd "s" request runs without reuse
    assert sched.waiting_tokens == 10 and sched.ready_tokens() == 16  # the two admitted are not written yet
    for s, _, b in chunks:
        s.n_cached = b
    assert sched.ready_tokens() == 10  # no slot left for the third
    loop.close()


def test_a_released_session_whose_request_is_dropped_is_forgotten():
    """Trajectories cancelled while their requests wait for a slot, then released: dropping those requests
    forgets their sessions (nothing will free them), while a session whose other request still runs stays
    marked until that one ends; drain() forgets every session too. Before, each such session stayed for good."""
    from verl_agent.engine.scheduler import Scheduler
    from verl_agent.engine.sequence import Seq

    loop = asyncio.new_event_loop()
    sched = Scheduler(n_slots=1, max_num_batched_tokens=64)

    def seq(prompt, session):
        return Seq(prompt, SamplingParams(), 4, frozenset(), loop.create_future(), loop, session=session)

    busy = seq([1, 2, 3], "a")
    sched.add(busy)
    assert [s for s, _, _ in sched.schedule_prefill()] == [busy]  # holds the only slot
    for session in ["t0", "t1", "t2", "a"]:
        queued = seq([4, 5], session)
        sched.add(queued)
        queued.future.cancel()
        sched.release(session)
    assert sched._release_when_done == {"t0", "t1", "t2", "a"}
    sched.schedule_prefill()
    assert not sched.waiting and list(sched.running.values()) == [busy]  # the cancelled requests are dropped
    assert sched._release_when_done == {"a"}  # its running request frees the slot when it ends
    sched.finish(busy)
    assert sched._release_when_done == set() and sched.table.take_free() == 0  # freed, not parked

    sched = Scheduler(n_slots=1, max_num_batched_tokens=64)
    sched.add(seq([1, 2], "b"))
    sched.schedule_prefill()
    sched.add(seq([3, 4], "c"))
    sched.release("b"), sched.release("c")
    assert len(sched.drain()) == 2 and sched._release_when_done == set()
    loop.close()


async def test_a_weight_update_at_a_token_boundary_continues_under_the_new_weights(small_model):
    """Partial rollout: pause(interrupt=True) ends the call between two tokens, the weights change, and
    the same call goes on: its first k tokens are the old policy's sample, the rest the new policy's."""
    import copy

    from model_helpers import random_qwen2

    from verl_agent.rollout.stream import PausableEngine

    new_model = random_qwen2(seed=1)
    n, sp = 200, SamplingParams(temperature=1.0, max_new_tokens=200, seed=3)
    e = engine(copy.deepcopy(small_model), max_model_len=256)
    version = [0]
    pe = PausableEngine(e, version_of=lambda: version[0])
    call = asyncio.ensure_future(pe.generate(PROMPT, sp))
    await wait_for(lambda: e.metrics()["engine/decode_steps"] >= 10)
    assert await pe.pause(interrupt=True)
    assert pe._inflight == 0 and not call.done()  # stopped mid-generation, waiting for the gate
    await e.update_weights(new_model.state_dict().items())
    version[0] = 1
    pe.resume()
    out = await call
    assert len(out.token_ids) == n and out.finish_reason == "length" and pe.continued == 1
    k = out.versions.index(1)
    assert 10 <= k < n and out.versions == [0] * k + [1] * (n - k)
    assert e.metrics()["engine/requests_interrupted"] == 1
    old = await (e_old := engine(small_model, max_model_len=256)).generate(PROMPT, SamplingParams(
        temperature=1.0, max_new_tokens=k, seed=3))
    new = await (e_new := engine(new_model, max_model_len=256)).generate(PROMPT + out.token_ids[:k], SamplingParams(
        temperature=1.0, max_new_tokens=n - k, seed=3 + k))
    assert out.token_ids == old.token_ids + new.token_ids
    assert out.logprobs == pytest.approx(old.logprobs + new.logprobs, abs=1e-5)
    for x in (e, e_old, e_new):
        await x.close()


async def test_counter_changes_give_one_rounds_work_and_keep_gauges(small_model):
    """What the trainer logs per step: counters differenced between two metrics() calls, gauges as they are."""
    from verl_agent.engine.contract import ENGINE_GAUGES, counter_changes

    eng = engine(small_model, max_num_seqs=4)
    sp = SamplingParams(temperature=0.0, max_new_tokens=6)
    await asyncio.gather(*(eng.generate(PROMPT, sp) for _ in range(3)))
    before = eng.metrics()
    await asyncio.gather(*(eng.generate(PROMPT + [20 + i], sp) for i in range(2)))
    step = counter_changes(before, eng.metrics())
    assert step["engine/requests"] == 2 and step["engine/generated_tokens"] == 12
    assert step["engine/prefill_tokens"] == 2 * (len(PROMPT) + 1) and step["engine/decode_s"] > 0
    assert step["engine/kv_slots"] == before["engine/kv_slots"] == 4  # a gauge, not differenced
    assert set(ENGINE_GAUGES) <= set(step)  # the gauge names are the engine's own
    await eng.close()


async def test_the_rest_of_a_burst_is_prefilled_without_waiting_for_pacing(tiny_model_path):
    """9 prompts of 500 tokens, 2048-token chunks: 4 + 4 + 1 rows. The third chunk is smaller than the budget,
    but it is the rest of a burst whose previous chunk was cut by the budget, so it runs at the next step
    instead of waiting out the pacing (twice a 2000-token chunk's time: 31 decode steps in all before)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_path)).eval()
    eng = engine(model, max_num_seqs=16, max_model_len=600, max_num_batched_tokens=2048)
    sp = SamplingParams(temperature=0.0, max_new_tokens=16)
    outs = await asyncio.gather(*(eng.generate([5 + i] * 500, sp) for i in range(9)))
    assert all(len(o.token_ids) == 16 for o in outs)
    m = eng.metrics()
    assert m["engine/prefill_chunks"] == 3
    assert m["engine/decode_steps"] <= 16 + 3  # 15 steps for the last rows, plus one before each later chunk
    await eng.close()
