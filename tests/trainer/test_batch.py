"""Batching invariance (STYLE 13): the trainer's micro-batched log-probs == each sequence computed alone."""

from __future__ import annotations

import torch

from verl_agent.trainer.policy.actor import forward_log_probs, split_padded
from verl_agent.trainer.policy.batch import TrainSeq


def _padded_log_probs(model, seqs):
    width = max(s.num_tokens for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    attn = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : s.num_tokens] = torch.tensor(s.input_ids)
        attn[i, : s.num_tokens] = 1
    logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits.float()
    out = []
    for i, s in enumerate(seqs):
        rows = torch.arange(s.prompt_len - 1, s.num_tokens - 1)
        out.append(logits[i, rows].log_softmax(-1).gather(-1, ids[i, rows + 1][:, None]).squeeze(-1))
    return out


def test_packed_equals_padded(dev_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(dev_model_path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    seqs = [TrainSeq(input_ids=torch.randint(3, vocab, (n,), generator=g).tolist(), prompt_len=p, loss_mask=torch.ones(n - p))
            for n, p in [(17, 5), (40, 12), (9, 1), (25, 20)]]
    with torch.no_grad():
        packed, _ = forward_log_probs(model, seqs, 1.0, torch.device("cpu"))
        padded = _padded_log_probs(model, seqs)
    for a, b in zip(packed, padded):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_split_padded_respects_the_padded_budget_and_keeps_everything():
    lengths = [30, 5, 70, 200, 40, 10, 65]
    groups = split_padded(lengths, 100)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:  # count x longest <= budget, except an over-long sequence that sits alone
        assert len(g) == 1 or len(g) * max(lengths[i] for i in g) <= 100
    assert [3] in groups
