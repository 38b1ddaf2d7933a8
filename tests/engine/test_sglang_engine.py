"""The `sglang` engine against a REAL SGLang 0.5.23 server on CPU (one server for the module).

Nothing is faked: the server is SGLang's own `launch_server` on its plain-torch CPU path. The
only stand-ins are the two test-only shims in tests/sglang_shims (a plain-torch `sgl_kernel` and
a `torch.get_device_module` fix), because SGLang's kernels package is CUDA-only. Not covered on
CPU: seeded sampling (SGLang needs --enable-deterministic-inference, CUDA only) and real memory
release (CPU has no memory saver; the calls and their bookkeeping are still exercised).
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from sglang_cpu import CPU_ARGS, CPU_ENV, sglang_python
from verl_agent.engine.contract import SamplingParams, check_output
from verl_agent.engine.backends.sglang_engine import SGLangEngine

pytestmark = [pytest.mark.sglang, pytest.mark.slow]
PROMPTS = [[5, 17, 42, 99, 3], [120, 7, 7, 300], [11]]


@pytest.fixture(scope="module")
def server(tiny_model_path):
    engine = SGLangEngine(model_path=tiny_model_path, python=sglang_python(), extra_args=CPU_ARGS, env=CPU_ENV)
    try:
        asyncio.run(engine.start())  # ~30-60 s on 2 cores
        yield engine
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def hf(tiny_model_path):
    return AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32).eval()


def hf_logprobs(model, prompt: list[int], out: list[int], temperature: float = 1.0) -> torch.Tensor:
    ids = torch.tensor([prompt + out])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return (logits / temperature).log_softmax(-1).gather(-1, torch.tensor(out)[:, None])[:, 0]


def perturbed(model, seed: int):
    """A copy of `model` with noise on every parameter (so generations visibly change)."""
    other = type(model)(model.config).eval()
    other.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    return other


async def assert_serves(engine: SGLangEngine, model, temperature: float = 0.0) -> list[list[int]]:
    """Greedy (or sampled) outputs of all PROMPTS, concurrently, with log-probs equal to `model`'s."""
    sp = SamplingParams(temperature=temperature, max_new_tokens=8)
    outs = await asyncio.gather(*(engine.generate(p, sp) for p in PROMPTS))
    for p, o in zip(PROMPTS, outs):
        check_output(o, sp)
        ref = hf_logprobs(model, p, o.token_ids, temperature or 1.0)
        torch.testing.assert_close(torch.tensor(o.logprobs), ref, atol=1e-3, rtol=0)
        if temperature == 0:  # greedy: every token is the model's argmax
            assert o.finish_reason in ("stop", "length")
    return [o.token_ids for o in outs]


async def test_generate_logprobs_match_transformers(server, hf):
    greedy = await assert_serves(server, hf)
    alone = [(await server.generate(p, SamplingParams(temperature=0.0, max_new_tokens=8))).token_ids for p in PROMPTS]
    assert alone == greedy  # concurrent requests each get their own answer
    await assert_serves(server, hf, temperature=0.7)  # log_softmax(logits / T), before top-k/top-p
    first = greedy[0]
    stop = SamplingParams(temperature=0.0, max_new_tokens=8, stop_token_ids=[first[2]])
    out = await server.generate(PROMPTS[0], stop)
    assert out.token_ids == first[: first.index(first[2]) + 1] and out.finish_reason == "stop"
    top = await server.generate(PROMPTS[1], SamplingParams(temperature=1.0, top_k=1, max_new_tokens=8))
    assert top.token_ids == greedy[1]  # top_k=1 is greedy


async def test_update_weights_from_tensors_then_restore_from_disk(server, hf, tiny_model_path):
    before = await assert_serves(server, hf)
    new = perturbed(hf, seed=1)
    await server.update_weights(new.named_parameters())  # shared-memory tensors, begin/end session
    after = await assert_serves(server, new)
    assert after != before
    await server.update_weights_from_disk(tiny_model_path)
    assert await assert_serves(server, hf) == before


async def test_update_weights_from_disk_path(server, hf, tiny_model_path):
    new = perturbed(hf, seed=2)
    await server.update_weights(new.state_dict().items(), method="disk")  # temp safetensors checkpoint
    await assert_serves(server, new)
    await server.update_weights_from_disk(tiny_model_path)
    await assert_serves(server, hf)


async def test_sleep_update_while_asleep_wake_up(server, hf, tiny_model_path):
    before = await assert_serves(server, hf)
    await server.sleep()
    new = perturbed(hf, seed=3)
    await server.update_weights(new.named_parameters())  # resumes the weights' memory first
    assert server._released == {"kv_cache", "cuda_graph"}
    await server.wake_up()
    await assert_serves(server, new)
    await server.sleep()
    await server.wake_up()
    await server.update_weights_from_disk(tiny_model_path)
    assert await assert_serves(server, hf) == before
    await server.flush_cache()
    assert await server.health() and await server.health(generate=True)


async def test_bad_input_is_rejected_and_server_survives(server, hf):
    vocab = hf.config.vocab_size
    with pytest.raises(ValueError, match="outside vocab"):  # SGLang itself would crash on this id
        await server.generate([1, vocab + 5], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError, match="unknown weight names"):
        await server.update_weights([("model.no_such.weight", torch.zeros(2))])
    assert await server.health()


async def test_agent_loop_on_sglang(server, hf, tiny_model_path):
    from verl_agent.config import RolloutConfig
    from verl_agent.data import row_to_sample
    from verl_agent.models.calculator_task import calculator_reward, make_problems, make_verl_rows
    from verl_agent.reward import load_reward_fn
    from verl_agent.rollout.agent_loop import AgentLoop
    from verl_agent.tools import CalculatorTool

    tok = AutoTokenizer.from_pretrained(str(tiny_model_path))
    rows = make_verl_rows(make_problems(3, seed=5, split="test"), "test")
    samples = [row_to_sample(r, f"test:{i}") for i, r in enumerate(rows)]
    loop = AgentLoop(server, tok, RolloutConfig(), tools={"calculator": CalculatorTool()},
                     reward_fn=load_reward_fn(f"{calculator_reward.__module__}.calculator_reward"),
                     max_prompt_length=256, max_response_length=128)  # fmt: skip
    batch = await loop.run(samples, n=2, sampling=SamplingParams(temperature=1.0, max_new_tokens=48))
    assert len(batch) == 6
    for traj in batch.trajectories:
        assert traj.error is None, traj.error
        traj.check()
        ids = torch.tensor([traj.prompt_ids + traj.response_ids])
        with torch.no_grad():
            logits = hf(ids).logits[0, len(traj.prompt_ids) - 1 : -1]
        ref = logits.log_softmax(-1).gather(-1, ids[0, len(traj.prompt_ids) :, None]).squeeze(-1)
        mask = torch.tensor(traj.loss_mask, dtype=torch.bool)
        assert mask.any()
        torch.testing.assert_close(torch.tensor(traj.rollout_logprobs)[mask], ref[mask], atol=2e-3, rtol=0)
    assert sum(len(t.turns) for t in batch.trajectories) >= 6
