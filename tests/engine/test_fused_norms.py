"""The engine's fused RMSNorm layers (engine/runner/fused_norms.py): same samples as the model's own norms, the
fused kernel really runs inside the engine's forward and nowhere else, and norm variants with another
formula keep their forward."""

from __future__ import annotations

import asyncio

import pytest
import torch
from model_helpers import random_qwen2
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from verl_agent.engine.contract import SamplingParams
from verl_agent.engine.runner.fused_norms import FusedNorms, fuse_norms
from verl_agent.engine.backends.hf_engine import HFEngine

PROMPTS = [[5 + i + j for j in range(1 + i % 4)] for i in range(8)]
SP = [SamplingParams(temperature=1.0, max_new_tokens=12, seed=i) for i in range(len(PROMPTS))]


def _model(dtype: torch.dtype) -> nn.Module:
    """A random Qwen2 whose norm weights are not all ones (so that the weight's multiply is tested too)."""
    model = random_qwen2(seed=3, layers=3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3, generator=torch.Generator().manual_seed(len(name)))
    return model.to(dtype)


async def _sample(fused: bool, dtype: torch.dtype) -> tuple[list, HFEngine]:
    engine = HFEngine(_model(dtype), stop_on_eos=False, max_model_len=64, fused_norms=fused)
    try:
        return await asyncio.gather(*(engine.generate(p, s) for p, s in zip(PROMPTS, SP))), engine
    finally:
        await engine.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_norms_sample_what_the_models_own_norms_sample(dtype):
    """Same seeds, same tokens and log-probs with and without the fused norms; every norm of the model (two a
    layer and the final one) is switched, and the fused kernel is what a forward calls."""
    fused, engine = asyncio.run(_sample(True, dtype))
    plain, plain_engine = asyncio.run(_sample(False, dtype))
    runner = engine._batcher.runner
    assert len(runner.norms) == 2 * 3 + 1 and plain_engine._batcher.runner.norms is None
    assert not any(type(m).__name__.startswith("Fused") for m in engine.model.modules())  # outside the engine
    assert [o.token_ids for o in fused] == [o.token_ids for o in plain]
    for a, b in zip(fused, plain):
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-6, rtol=0)
    with runner.norms.active(), torch.profiler.profile() as prof, torch.no_grad():
        assert all(type(m).__name__ == "FusedQwen2RMSNorm" for m, _, _ in runner.norms.layers)
        engine.model(torch.tensor([PROMPTS[0]]))
    assert sum(e.name == "aten::_fused_rms_norm" for e in prof.events()) == len(runner.norms)


class OffsetRMSNorm(nn.Module):
    """A norm scaled by ``1 + weight`` (Gemma's form): the fused forward would give another output."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden))
        self.variance_epsilon = 1e-6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


def test_a_norm_with_another_formula_keeps_its_forward():
    model = nn.ModuleDict({"offset": OffsetRMSNorm(32), "llama": LlamaRMSNorm(32)})
    x = torch.randn(3, 32)
    before = model["offset"](x)
    norms = FusedNorms(model)
    assert len(norms) == 1
    with norms.active():
        assert type(model["offset"]) is OffsetRMSNorm and type(model["llama"]).__name__ == "FusedLlamaRMSNorm"
        torch.testing.assert_close(model["offset"](x), before, atol=0, rtol=0)
    assert type(model["llama"]) is LlamaRMSNorm  # back to its own class after the engine's forward


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_trained_through_fused_norms_the_gradients_are_the_models_own(dtype):
    """`fuse_norms` (the trainer's copy, switched for good): loss and every parameter's gradient equal the
    model's own norms' with gradient checkpointing on, and the forward runs the fused kernel."""
    ids = torch.randint(2, 96, (2, 17), generator=torch.Generator().manual_seed(0))
    grads = {}
    for fused in (False, True):
        model = _model(dtype).train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if fused:
            assert fuse_norms(model) == 2 * 3 + 1
        with torch.profiler.profile() as prof:
            loss = model(ids, labels=ids).loss
            loss.backward()
        calls = sum(e.name == "aten::_fused_rms_norm" for e in prof.events())
        assert calls == (2 * (2 * 3) + 1 if fused else 0)  # each layer's two norms again in its recompute
        grads[fused] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    tol = {"atol": 1e-6, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(grads[True][0], grads[False][0], **tol)
    for name, g in grads[False][1].items():
        torch.testing.assert_close(grads[True][1][name], g, **tol, msg=lambda m, n=name: f"{n}: {m}")
