"""Shared-prefix packing on a GPU: bf16 compute, sdpa picks its CUDA kernel for the 4-D mask (cuDNN or
memory-efficient), and the packed rows still give the padded rows' log-probs and gradients within bf16
tolerance. The CPU tests (test_shared_prefix.py) check exactness in fp32.

Skipped without CUDA. Also runnable as a script on a GPU box without pytest:
`python tests/trainer/test_shared_prefix_gpu.py`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

try:
    import pytest

    pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
except ImportError:  # plain-script use on a GPU box without pytest
    pytest = None


def _model():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=2048, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
                      attn_implementation="sdpa")
    return Qwen2ForCausalLM(cfg).to("cuda", torch.bfloat16)


def _groups(prompts: int = 4, gens: int = 8, prompt_len: int = 185, response_len: int = 64) -> list:
    from verl_agent.trainer.policy.batch import TrainSeq

    g = torch.Generator().manual_seed(0)
    seqs = []
    for p in range(prompts):
        prompt = torch.randint(3, 2048, (prompt_len,), generator=g).tolist()
        for _ in range(gens):
            response = torch.randint(3, 2048, (response_len,), generator=g).tolist()
            seqs.append(TrainSeq(input_ids=prompt + response, prompt_len=prompt_len, uid=f"p{p}",
                                 loss_mask=torch.ones(response_len), advantages=torch.randn(response_len, generator=g)))
    return seqs


def test_packed_rows_match_padded_rows_in_bf16_on_cuda() -> None:
    from verl_agent.trainer.policy.actor import forward_log_probs, shared_packs

    seqs, dev = _groups(), torch.device("cuda")
    grads, logps = [], []
    for k in (32, 0):
        model = _model()
        assert (shared_packs(model, seqs, k) is not None) == (k > 0)
        logp, _ = forward_log_probs(model, seqs, 1.0, dev, shared_prefix=k)
        sum((lp * s.advantages.to(dev) * s.loss_mask.to(dev)).sum() for lp, s in zip(logp, seqs)).backward()
        logps.append(torch.cat(logp).float())
        grads.append(torch.cat([p.grad.float().flatten() for p in model.parameters()]))
    assert torch.isfinite(logps[0]).all()
    assert (logps[0] - logps[1]).abs().max() < 0.05  # bf16: another summation order, a few ulps of ~8
    cos = torch.nn.functional.cosine_similarity(grads[0], grads[1], dim=0)
    assert cos > 0.999, float(cos)


if __name__ == "__main__":
    test_packed_rows_match_padded_rows_in_bf16_on_cuda()
    print("ok")
