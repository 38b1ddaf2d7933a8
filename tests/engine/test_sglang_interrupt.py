"""Partial rollout on a REAL SGLang 0.5.23 server on CPU: `SGLangEngine.interrupt` (``/abort_request``)
ends requests mid-generation, the weights change, and `PausableEngine` continues each one under the new
weights. The model is a random Qwen2 (it never emits its eos, so generations are long); the only stand-ins
are tests/sglang_shims (see test_sglang_engine.py).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from model_helpers import random_qwen2
from sglang_cpu import CPU_ARGS, CPU_ENV, sglang_python
from verl_agent.engine.contract import SamplingParams
from verl_agent.engine.backends.sglang_engine import SGLangEngine
from verl_agent.rollout.stream import PausableEngine

pytestmark = [pytest.mark.sglang, pytest.mark.slow]
PROMPTS = [[5 + i, 17, 42 + i, 99, 3] for i in range(8)]
N = 240  # the random model's context is 256


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("random-qwen2")
    random_qwen2(vocab=2000).save_pretrained(path)
    return path


def logprobs(model, prompt: list[int], out: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out])).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(out)[:, None])[:, 0]


async def test_interrupted_requests_continue_under_the_new_weights(model_dir):
    models = [random_qwen2(vocab=2000), random_qwen2(vocab=2000, seed=1)]  # [0] is what the server loaded
    engine = SGLangEngine(model_path=str(model_dir), python=sglang_python(), extra_args=CPU_ARGS, env=CPU_ENV)
    try:
        await engine.start()
        version = [0]
        pe = PausableEngine(engine, version_of=lambda: version[0])
        for _ in range(2):  # the second one is warm
            t0 = asyncio.get_running_loop().time()
            await engine.generate(PROMPTS[0], SamplingParams(temperature=1.0, max_new_tokens=N // 10))
            wait = 4 * (asyncio.get_running_loop().time() - t0)  # about 4/10 of N tokens alone
        sp = SamplingParams(temperature=1.0, max_new_tokens=N)
        cut = 0
        for _attempt in range(4):  # the cut point is a matter of timing: retry with a shorter or longer wait
            calls = [asyncio.ensure_future(pe.generate(p, sp)) for p in PROMPTS]
            await asyncio.sleep(wait)
            interrupted = await pe.pause(interrupt=True)
            v = version[0]
            old, new = models[v % 2], models[(v + 1) % 2]
            await engine.update_weights(new.state_dict().items())
            version[0] = v + 1
            pe.resume()
            ks = []
            for prompt, out in zip(PROMPTS, await asyncio.gather(*calls)):
                n = len(out.token_ids)  # N, or fewer where the random model sampled its eos (1 in 2000 a token)
                assert (n == N and out.finish_reason == "length") or (out.finish_reason == "stop"
                                                                      and out.token_ids[-1] == 1)  # fmt: skip
                k = out.versions.count(v)
                assert out.versions == [v] * k + [v + 1] * (n - k)
                got = torch.tensor(out.logprobs)
                if k:  # the old weights' tokens, then the new weights' after the same prefix
                    torch.testing.assert_close(got[:k], logprobs(old, prompt, out.token_ids[:k]), atol=1e-3, rtol=0)
                if k < n:
                    torch.testing.assert_close(got[k:], logprobs(new, prompt + out.token_ids[:k], out.token_ids[k:]),
                                               atol=1e-3, rtol=0)  # fmt: skip
                ks.append(k)
                cut += 0 < k < n
            if cut >= 2:
                break
            wait = wait / 4 if not interrupted or min(ks) == N else wait * 4  # all done before, or none started
        assert cut >= 2 and pe.continued >= cut  # interrupted mid-generation, continued under the new weights
    finally:
        engine.shutdown()
