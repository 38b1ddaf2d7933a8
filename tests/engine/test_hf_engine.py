"""HFEngine on CPU with real transformers models: contract, padding, log-probs, per-request params, weights."""

from __future__ import annotations

import asyncio

import pytest
import torch
from model_helpers import random_qwen2

from verl_agent.engine.contract import EngineContractError, SamplingParams, check_engine
from verl_agent.engine.backends.hf_engine import EngineClosedError, HFEngine, HFEngineSettings

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [15], [16, 17, 18, 19, 20]]


def full_logprobs(model, prompt, gen, temperature=1.0):
    """Log-probs of `gen` after `prompt` from one unpadded forward pass (the trainer's view)."""
    ids = torch.tensor([prompt + gen])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    return logits.log_softmax(-1).gather(-1, torch.tensor(gen)[:, None]).squeeze(-1)


async def test_check_engine_passes(small_model):
    engine = HFEngine(small_model, stop_on_eos=False)
    await check_engine(engine, max_new_tokens=12)
    await engine.close()


async def test_check_engine_catches_a_mixing_engine(small_model):
    engine = HFEngine(small_model, stop_on_eos=False)

    class Mixed:  # returns the answer of the previous request: the bug the checker exists for
        last = None

        async def generate(self, prompt_ids, sampling, session=None):
            out, self.last = self.last, await engine.generate(prompt_ids, sampling)
            return out or self.last

        update_weights, sleep, wake_up, close = engine.update_weights, engine.sleep, engine.wake_up, engine.close
        release_session = engine.release_session

    with pytest.raises(EngineContractError):
        await check_engine(Mixed(), max_new_tokens=6)
    await engine.close()


async def test_batched_greedy_equals_hf_generate(small_model):
    """Padding/positions are right: concurrent requests of different lengths give transformers' greedy output."""
    engine = HFEngine(small_model, stop_on_eos=False)
    sp = SamplingParams(temperature=0.0, max_new_tokens=10)
    outs = await asyncio.gather(*(engine.generate(p, sp) for p in PROMPTS))
    for p, out in zip(PROMPTS, outs):
        ref = small_model.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, eos_token_id=None)
        assert out.token_ids == ref[0, len(p) :].tolist()
        assert out.finish_reason == "length"
    # the first request starts at once, the other three join it at the next step
    m = engine.metrics()
    assert m["engine/prefill_chunks"] <= 2
    assert m["engine/decode_rows"] == 4 * 9 and m["engine/decode_steps"] < 4 * 9  # they shared steps
    await engine.close()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_logprobs_match_a_full_forward(small_model, temperature):
    engine = HFEngine(small_model, stop_on_eos=False)
    sp = SamplingParams(temperature=temperature, max_new_tokens=12, top_k=20, top_p=0.9)
    outs = await asyncio.gather(*(engine.generate(p, sp) for p in PROMPTS))
    for p, out in zip(PROMPTS, outs):
        ref = full_logprobs(small_model, p, out.token_ids, temperature)
        torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=2e-4, rtol=0)
    await engine.close()


async def test_per_request_params_in_one_batch(small_model):
    engine = HFEngine(small_model, stop_on_eos=False)
    greedy = await engine.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_new_tokens=8))
    stop_at = greedy.token_ids[2]
    reqs = [
        (PROMPTS[1], SamplingParams(temperature=0.0, max_new_tokens=3)),
        (PROMPTS[1], SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=[stop_at])),
        (PROMPTS[1], SamplingParams(temperature=1.0, top_k=1, max_new_tokens=8)),  # top-1 sampling is greedy
        (PROMPTS[1], SamplingParams(temperature=1.0, top_p=1e-6, max_new_tokens=8)),  # so is a tiny nucleus
        (PROMPTS[0], SamplingParams(temperature=1.0, max_new_tokens=8, seed=7)),
        (PROMPTS[0], SamplingParams(temperature=1.0, max_new_tokens=8, seed=7)),
    ]
    a, b, c, d, e, f = await asyncio.gather(*(engine.generate(p, s) for p, s in reqs))
    assert a.token_ids == greedy.token_ids[:3] and a.finish_reason == "length"
    first = greedy.token_ids.index(stop_at)
    assert b.token_ids == greedy.token_ids[: first + 1] and b.finish_reason == "stop"
    assert c.token_ids == greedy.token_ids == d.token_ids
    assert e.token_ids == f.token_ids
    alone = await engine.generate(PROMPTS[0], SamplingParams(temperature=1.0, max_new_tokens=8, seed=7))
    assert alone.token_ids == e.token_ids  # a seed gives the same sample whatever the batch around it
    await engine.close()


async def test_many_concurrent_requests_never_mix(small_model):
    engine = HFEngine(small_model, max_num_seqs=16, stop_on_eos=False)
    prompts = [[(i * 7 + j) % 90 + 2 for j in range(1 + i % 9)] for i in range(40)]
    sps = [SamplingParams(temperature=0.0, max_new_tokens=1 + i % 8) for i in range(40)]  # rows leave the batch early
    together = await asyncio.gather(*(engine.generate(p, sp) for p, sp in zip(prompts, sps)))
    for p, sp, out in list(zip(prompts, sps, together))[::3]:
        alone = await engine.generate(p, sp)
        assert alone.token_ids == out.token_ids and len(out.token_ids) == sp.max_new_tokens
        assert alone.logprobs == pytest.approx(out.logprobs, abs=1e-4)
    assert engine.metrics()["engine/kv_slots"] == 16  # 40 requests through 16 slots
    await engine.close()


async def test_event_loop_keeps_running_during_a_batch(small_model):
    engine = HFEngine(small_model, stop_on_eos=False)
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0.001)

    t = asyncio.ensure_future(ticker())
    await asyncio.gather(*(engine.generate(p, SamplingParams(max_new_tokens=120)) for p in PROMPTS * 4))
    t.cancel()
    assert ticks > 10
    await engine.close()


async def test_eos_stops_by_default(small_model):
    engine = HFEngine(small_model)  # eos id 1 from the model config
    sp = SamplingParams(temperature=0.0, max_new_tokens=4)
    first = (await HFEngine(small_model, stop_on_eos=False).generate([3], sp)).token_ids[0]
    small_model.generation_config.eos_token_id = [first]
    engine = HFEngine(small_model)
    out = await engine.generate([3], sp)
    assert out.token_ids == [first] and out.finish_reason == "stop"
    small_model.generation_config.eos_token_id = 1


async def test_update_weights_sleep_wake_close(small_model):
    engine = HFEngine(random_qwen2(seed=1), stop_on_eos=False)
    sp = SamplingParams(temperature=0.0, max_new_tokens=8)
    before = await engine.generate(PROMPTS[1], sp)
    await engine.update_weights((k, v.clone()) for k, v in small_model.state_dict().items())
    assert engine.policy_version == 1
    mine = await HFEngine(small_model, stop_on_eos=False).generate(PROMPTS[1], sp)
    after = await engine.generate(PROMPTS[1], sp)
    assert after.token_ids == mine.token_ids
    assert after.logprobs == pytest.approx(mine.logprobs, abs=1e-5)
    assert after.logprobs != pytest.approx(before.logprobs, abs=1e-3)
    with pytest.raises(KeyError, match="no.such"):
        await engine.update_weights([("no.such.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape"):
        await engine.update_weights([("model.norm.weight", torch.zeros(3))])
    await engine.sleep()
    with pytest.raises(RuntimeError, match="asleep"):
        await engine.generate(PROMPTS[1], sp)
    await engine.wake_up()
    assert (await engine.generate(PROMPTS[1], sp)).logprobs == pytest.approx(after.logprobs, abs=1e-5)
    await engine.close()
    with pytest.raises(EngineClosedError):
        await engine.generate(PROMPTS[1], sp)


async def test_engine_dtype_casts_parameters_not_the_rotary_buffer():
    """rollout.dtype=bfloat16 on a float32 model: the weights become bf16, the rotary inv_freq stays float32 as
    in the trainer's actor (a bf16 copy puts the phase off by radians a few thousand positions in)."""
    model = random_qwen2(seed=4)
    engine = HFEngine(model, dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    await engine.close()


def test_attention_the_slot_attention_cannot_reproduce_is_refused():
    """A sliding window shorter than a sequence's slot, or logit soft-capping, would sample other tokens than
    the trainer scores: refused by name, with the way out; a window at least the slot length runs."""
    from transformers import MistralConfig, MistralForCausalLM

    def mistral(**kw):
        cfg = MistralConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, **kw)
        return MistralForCausalLM(cfg).eval()

    with pytest.raises(ValueError, match=r"sliding window of 8 tokens, shorter than the 256 .*max_model_len <= 8"):
        HFEngine(mistral(sliding_window=8))
    HFEngine(mistral(sliding_window=4096))
    assert HFEngine(mistral(sliding_window=8), max_model_len=8).metrics()["engine/kv_tokens_per_slot"] == 8
    model = random_qwen2()
    model.config.attn_logit_softcapping = 50.0
    with pytest.raises(ValueError, match="attn_logit_softcapping.*sglang"):
        HFEngine(model)


async def test_close_aborts_running_and_queued_requests(small_model):
    """close() while requests decode: the running one ends "abort" with the tokens sampled so far, the one
    still queued for a slot ends "abort" with none, and neither caller is left waiting."""
    engine = HFEngine(small_model, stop_on_eos=False, max_num_seqs=1)
    sp = SamplingParams(max_new_tokens=500)
    running = asyncio.ensure_future(engine.generate(PROMPTS[0], sp))
    queued = asyncio.ensure_future(engine.generate(PROMPTS[1], sp))
    loop = asyncio.get_running_loop()
    end = loop.time() + 30
    while engine.metrics()["engine/decode_steps"] < 3:
        assert loop.time() < end, "no decode steps"
        await asyncio.sleep(0.001)
    await engine.close()
    a, b = await asyncio.wait_for(asyncio.gather(running, queued), 5)
    assert a.finish_reason == "abort" and 3 <= len(a.token_ids) < 500 and len(a.logprobs) == len(a.token_ids)
    assert (b.finish_reason, b.token_ids) == ("abort", [])


def test_settings_defaults_live_in_one_place_and_bad_settings_are_refused(small_model):
    """The rollout config's hf keys default to HFEngineSettings' values; keyword overrides take single
    fields; unknown or out-of-range settings, and the scheduler key a config may still carry, are refused
    by name."""
    from verl_agent.config import ConfigError, RolloutConfig, load_config
    from verl_agent.rollout.build import hf_engine_settings

    assert hf_engine_settings(RolloutConfig(), "cpu") == HFEngineSettings()
    assert hf_engine_settings(RolloutConfig(max_batch_size=8), "cpu", seed=3).max_num_seqs == 8
    assert hf_engine_settings(RolloutConfig(max_batch_size=8, max_num_seqs=3), "cpu").max_num_seqs == 3
    assert hf_engine_settings(RolloutConfig(enable_prefix_caching=False), "cpu").share_prompts is False
    engine = HFEngine(small_model, HFEngineSettings(max_num_seqs=3), max_model_len=40)
    assert (engine.settings.max_num_seqs, engine.settings.max_model_len) == (3, 40)
    assert engine.metrics()["engine/kv_slots"] == 3 and engine.metrics()["engine/kv_tokens_per_slot"] == 40
    with pytest.raises(TypeError, match=r"unknown settings \['scheduler'\]"):
        HFEngine(small_model, scheduler="batch")
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1, got 0.*gpu_memory_utilization"):
        HFEngineSettings(max_num_seqs=0, gpu_memory_utilization=1.5)
    with pytest.raises(ConfigError, match="rollout.scheduler': the hf engine has one scheduler"):
        load_config(None, ["actor_rollout_ref.rollout.scheduler=batch"])


async def test_bad_prompts_are_clear_errors(small_model):
    engine = HFEngine(small_model)
    with pytest.raises(ValueError, match="empty"):
        await engine.generate([], SamplingParams())
    with pytest.raises(ValueError, match="outside"):
        await engine.generate([1, 10_000], SamplingParams())
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    await engine.close()


async def test_sleep_discarding_weights_frees_them_and_needs_every_parameter_back():
    """The trainer's sleep: no host copy; generate refuses until update_weights has replaced every parameter
    (the tied LM head counts as loaded with the embedding), then answers as before."""
    model = random_qwen2(seed=2)
    saved = [(k, v.clone()) for k, v in model.state_dict().items() if k != "lm_head.weight"]  # tied: pushed once
    engine = HFEngine(model, stop_on_eos=False)
    sp = SamplingParams(temperature=0.0, max_new_tokens=8)
    before = await engine.generate(PROMPTS[1], sp)
    await engine.sleep(discard_weights=True)
    assert sum(p.numel() for p in model.parameters()) == 0  # nothing kept, on the device or elsewhere
    await engine.wake_up()
    with pytest.raises(RuntimeError, match="discarded by sleep"):
        await engine.generate(PROMPTS[1], sp)
    norm = "model.norm.weight"
    await engine.update_weights([(k, v) for k, v in saved if k != norm])
    with pytest.raises(RuntimeError, match=f"1 parameters \\(e.g. '{norm}'\\)"):
        await engine.generate(PROMPTS[1], sp)
    await engine.update_weights([(k, v) for k, v in saved if k == norm])
    after = await engine.generate(PROMPTS[1], sp)
    assert after.token_ids == before.token_ids and after.logprobs == pytest.approx(before.logprobs, abs=1e-6)
    await engine.close()


@pytest.mark.slow
async def test_torch_compiled_decode_samples_what_the_eager_one_does(small_model):
    """rollout.enable_torch_compile: the compiled decode step (CPU: inductor's C++ kernels) gives the eager
    engine's tokens (same seed) and log-probs within float tolerance."""
    prompts = PROMPTS * 3  # 12 rows: two decode row buckets as rows finish
    sp = [SamplingParams(temperature=1.0, max_new_tokens=8 + i, seed=i) for i in range(len(prompts))]
    outs = {}
    for compiled in (False, True):
        engine = HFEngine(small_model, stop_on_eos=False, torch_compile=compiled)
        frames = torch._dynamo.utils.counters["frames"]["ok"]
        outs[compiled] = await asyncio.gather(*(engine.generate(p, s) for p, s in zip(prompts, sp)))
        assert (torch._dynamo.utils.counters["frames"]["ok"] > frames) == compiled  # compiled only when asked
        await engine.close()
    for eager, comp in zip(outs[False], outs[True]):
        assert comp.token_ids == eager.token_ids
        assert torch.allclose(torch.tensor(comp.logprobs), torch.tensor(eager.logprobs), atol=1e-4)
