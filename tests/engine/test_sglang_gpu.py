"""GPU integration: the `sglang` engine on a real GPU SGLang server (no shims, memory saver on).

Runs automatically where CUDA and an SGLang interpreter exist ($SGLANG_PYTHON, else this
interpreter when it can import sglang); skipped elsewhere (CI has no GPU).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from verl_agent.engine.contract import SamplingParams
from verl_agent.engine.backends.sglang_engine import SGLangEngine

pytestmark = [pytest.mark.gpu, pytest.mark.sglang, pytest.mark.slow]


def _gpu_sglang_python() -> str:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    python = os.environ.get("SGLANG_PYTHON")
    if python is None and importlib.util.find_spec("sglang") is not None:
        python = sys.executable
    if python is None or subprocess.run([python, "-c", "import sglang"], capture_output=True).returncode != 0:
        pytest.skip("no SGLang interpreter (set SGLANG_PYTHON)")
    return python


async def test_sglang_on_gpu(tiny_model_path):
    engine = SGLangEngine(model_path=tiny_model_path, python=_gpu_sglang_python(),
                          extra_args=["--dtype", "float32", "--enable-memory-saver", "--mem-fraction-static", "0.2"])  # fmt: skip
    try:
        hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_path), dtype=torch.float32).cuda().eval()
        prompt, sp = [5, 17, 42, 99], SamplingParams(temperature=0.0, max_new_tokens=8)
        out = await engine.generate(prompt, sp)
        ids = torch.tensor([prompt + out.token_ids], device="cuda")
        with torch.no_grad():
            ref = hf(ids).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
        ref = ref.gather(-1, ids[0, len(prompt) :, None])[:, 0].cpu()
        torch.testing.assert_close(torch.tensor(out.logprobs), ref, atol=2e-3, rtol=0)
        with torch.no_grad():
            for p in hf.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        await engine.sleep()
        await engine.update_weights(hf.named_parameters())  # CUDA IPC handles
        await engine.wake_up()
        new = await engine.generate(prompt, sp)
        ids = torch.tensor([prompt + new.token_ids], device="cuda")
        with torch.no_grad():
            ref = hf(ids).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
        torch.testing.assert_close(torch.tensor(new.logprobs), ref.gather(-1, ids[0, len(prompt) :, None])[:, 0].cpu(),
                                   atol=2e-3, rtol=0)  # fmt: skip
    finally:
        await engine.close()
