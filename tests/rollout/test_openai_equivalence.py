"""The endpoint + the example openai agent give exactly the native agent loop's trajectories (tiny model, fixed seed)."""

from __future__ import annotations

import pytest

from verl_agent.config import load_config
from verl_agent.data import row_to_sample
from verl_agent.models.calculator_task import make_problems, make_verl_rows
from verl_agent.rollout.openai.agent_function import AgentFunctionLoop
from verl_agent.rollout.agent_loop import AgentLoop
from verl_agent.rollout.build import build_rollout, rollout_in_chunks, sampling_params

pytest.importorskip("openai")


def _samples(n: int):
    rows = make_verl_rows(make_problems(n, seed=5, split="test"), "test")
    return [row_to_sample(r, f"test:{i}") for i, r in enumerate(rows)]


async def _rollout(config: str, samples, seed: int):
    # one KV slot, so one request per forward pass: rows next to other requests change log-probs by float rounding, and
    # the two runs interleave their requests differently (their tokens agree either way)
    cfg = load_config(config, ["actor_rollout_ref.rollout.max_num_seqs=1"])
    parts = build_rollout(cfg, device="cpu", seed=0)
    sp = sampling_params(cfg.actor_rollout_ref.rollout, cfg.data, seed=seed)
    try:
        return parts.agent, await rollout_in_chunks(parts.agent, samples, n=2, sampling=sp)
    finally:
        await parts.engine.close()


async def test_openai_agent_matches_native_loop_token_for_token():
    samples = _samples(4)
    native_loop, native = await _rollout("examples/calculator/config.yaml", samples, seed=11)
    proxy_loop, proxied = await _rollout("examples/openai_agent/config.yaml", samples, seed=11)
    assert isinstance(native_loop, AgentLoop) and isinstance(proxy_loop, AgentFunctionLoop)
    assert len(native) == len(proxied) == 8
    assert any(len(t.turns) > 1 for t in native), "the seed should exercise at least one tool round trip"
    for a, b in zip(native, proxied):
        assert (a.uid, a.prompt_ids, a.response_ids, a.loss_mask) == (b.uid, b.prompt_ids, b.response_ids, b.loss_mask)
        assert a.rollout_logprobs == b.rollout_logprobs
        assert [(t.gen_start, t.gen_end, t.obs_end) for t in a.turns] == [(t.gen_start, t.gen_end, t.obs_end) for t in b.turns]
        assert (a.reward, a.outcome, a.stop_reason) == (b.reward, b.outcome, b.stop_reason)
    assert proxy_loop.counts["history_rewrites"] == 0
