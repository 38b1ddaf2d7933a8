"""Shared prompts in the hf engine (scheduler.py, `share_prompts`): the samples of a group copy the first
sample's prompt K/V and prefill one token, and get what they get with every prompt prefilled."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from verl_agent.engine.backends.hf_engine import HFEngine
from verl_agent.engine.contract import SamplingParams
from verl_agent.engine.scheduler import Scheduler
from verl_agent.engine.sequence import Seq, SeqState

A = [(5 * i) % 80 + 3 for i in range(20)]
B = [(3 * i) % 70 + 4 for i in range(13)]


def engine(model, **kw) -> HFEngine:
    return HFEngine(model, stop_on_eos=False, max_model_len=96, **kw)


async def groups(e: HFEngine, temperature: float) -> list:
    """Two groups of four samples (seeded), all in the engine's inbox before its thread takes any of them:
    the engine thread is held by a task queued ahead of its serving loop until every request is submitted."""
    gate = threading.Event()
    e._executor.submit(gate.wait)
    calls = [asyncio.ensure_future(e.generate(p, SamplingParams(temperature=temperature, max_new_tokens=10,
                                                                seed=100 * g + i)))
             for g, p in enumerate((A, B)) for i in range(4)]  # fmt: skip
    await asyncio.sleep(0)  # each call runs up to its wait: all eight are queued
    gate.set()
    return await asyncio.gather(*calls)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
async def test_a_groups_samples_share_the_prompt_and_sample_what_they_would_alone(small_model, temperature):
    shared, plain = engine(small_model), engine(small_model, share_prompts=False)
    got, ref = await groups(shared, temperature), await groups(plain, temperature)
    for a, b in zip(ref, got):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs), atol=1e-5, rtol=0)
    m, m_plain = shared.metrics(), plain.metrics()
    assert m["engine/prefill_tokens_shared"] == 3 * (len(A) - 1) + 3 * (len(B) - 1)
    assert m_plain["engine/prefill_tokens_shared"] == 0
    assert m_plain["engine/prefill_tokens"] == 4 * (len(A) + len(B))
    assert m["engine/prefill_tokens"] == len(A) + len(B) + 6  # each follower prefills its last prompt token
    assert m["engine/prefill_chunks"] == 2  # the followers' chunk right after their donors', in the same step
    await shared.close()
    await plain.close()


def _seq(loop, prompt: list[int]) -> Seq:
    return Seq(list(prompt), SamplingParams(), max_new=4, stops=frozenset(), future=loop.create_future(), loop=loop)


def test_a_follower_waits_for_its_donors_prefill_then_copies_it():
    """The follower holds its slot but stays out of the chunks while the donor's prompt is being prefilled
    (here over two chunks); then one copy is queued and it prefills the last token alone."""
    loop = asyncio.new_event_loop()
    sched = Scheduler(n_slots=4, max_num_batched_tokens=12)
    donor, follower, other = _seq(loop, A), _seq(loop, A), _seq(loop, B)
    for s in (donor, follower, other):
        sched.add(s)
    first = sched.schedule_prefill()
    assert first == [(donor, 0, 12)] and follower.slot >= 0 and follower.state is SeqState.PREFILL
    donor.n_cached = 12
    assert sched.schedule_prefill() == [(donor, 12, len(A))] and not sched.take_copies()
    donor.n_cached, donor.state = len(A), SeqState.DECODE
    third = sched.schedule_prefill()
    assert third[0] == (follower, len(A) - 1, len(A)) and [s for s, _, _ in third[1:]] == [other]
    assert sched.take_copies() == [(donor.slot, follower.slot, len(A) - 1)]
    assert sched.counters["prefill_tokens_shared"] == len(A) - 1
    loop.close()


def test_a_follower_whose_donor_ends_first_prefills_its_whole_prompt():
    loop = asyncio.new_event_loop()
    sched = Scheduler(n_slots=3, max_num_batched_tokens=64)
    donor, follower = _seq(loop, A), _seq(loop, A)
    sched.add(donor)
    sched.add(follower)
    assert [s for s, _, _ in sched.schedule_prefill()] == [donor]
    sched.finish(donor, keep_session=False)  # failed or cancelled during its prefill
    chunks = sched.schedule_prefill()
    assert chunks == [(follower, 0, len(A))] and not sched.take_copies()
    late = _seq(loop, A)  # the follower is now the one a later request copies from
    sched.add(late)
    follower.n_cached, follower.state = len(A), SeqState.DECODE
    assert sched.schedule_prefill() == [(late, len(A) - 1, len(A))]
    assert sched.take_copies() == [(follower.slot, late.slot, len(A) - 1)]
    loop.close()
