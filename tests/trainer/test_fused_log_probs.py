"""Chunked log-probs (`losses.chunked_log_probs`, `actor.LogProbHead`) equal the plain full-logits computation,
in value and gradient; the on-policy shortcut (old_log_probs None) gives PPO's update at ratio 1."""

from __future__ import annotations

import copy
import weakref

import pytest
import torch
from torch.testing import assert_close
from torch.utils._python_dispatch import TorchDispatchMode

from verl_agent.trainer.policy.actor import LogProbHead, MicroBatching, forward_log_probs, update_actor
from verl_agent.trainer.algorithms import entropy_from_logits
from verl_agent.trainer.algorithms.losses import LOGIT_BUFFERS, chunked_log_probs


def _plain(h, w, t, temp):
    z = (h @ w.t()).float() / temp
    return z.log_softmax(-1).gather(-1, t[:, None]).squeeze(-1), entropy_from_logits(z)


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_equals_plain_value_and_gradient(chunk: int) -> None:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(23, 16, generator=g, requires_grad=True)
    w = torch.randn(50, 16, generator=g, requires_grad=True)
    t = torch.randint(0, 50, (23,), generator=g)
    a, b = torch.randn(23, generator=g), torch.randn(23, generator=g)
    logp, ent = chunked_log_probs(h, w, t, temperature=0.7, chunk=chunk, with_entropy=True)
    ref_logp, ref_ent = _plain(h, w, t, 0.7)
    assert_close(logp, ref_logp, rtol=1e-5, atol=1e-5)
    assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
    (logp @ a + ent @ b).backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    (ref_logp @ a + ref_ent @ b).backward()
    assert_close(gh, h.grad, rtol=1e-4, atol=1e-5)
    assert_close(gw, w.grad, rtol=1e-4, atol=1e-5)


def test_chunked_bf16_close_to_plain() -> None:
    g = torch.Generator().manual_seed(1)
    h = torch.randn(40, 32, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(300, 32, generator=g) * 0.2).bfloat16().requires_grad_()
    t = torch.randint(0, 300, (40,), generator=g)
    logp, ent = chunked_log_probs(h, w, t, chunk=16)
    assert ent is None and logp.dtype == torch.float32
    ref, _ = _plain(h, w, t, 1.0)
    assert_close(logp, ref, rtol=0, atol=1e-4)  # same bf16 matmul, same fp32 softmax
    logp.sum().backward()
    gw = w.grad.float()
    w.grad = None
    ref.sum().backward()
    assert_close(gw, w.grad.float(), rtol=2e-2, atol=2e-2)


class _LiveBigTensors(TorchDispatchMode):
    """Tracks the bytes of live tensors of at least `numel` elements (by storage), and their peak."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.live, self.peak = numel, {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor) and t.numel() >= self.numel:
                key = t.untyped_storage().data_ptr()
                if key not in self.live:
                    self.live[key] = t.untyped_storage().nbytes()
                    weakref.finalize(t.untyped_storage(), self.live.pop, key, None)
        self.peak = max(self.peak, sum(self.live.values()))
        return out


@pytest.mark.parametrize("with_entropy", [False, True])
def test_chunked_head_holds_at_most_the_planned_logit_buffers(with_entropy: bool) -> None:
    """The memory plan counts LOGIT_BUFFERS fp32 [chunk, vocab] buffers for the head, forward and backward."""
    g = torch.Generator().manual_seed(0)
    chunk, vocab = 8, 4096
    h = torch.randn(32, 16, generator=g).bfloat16().requires_grad_()
    w = torch.randn(vocab, 16, generator=g).bfloat16().requires_grad_()
    t = torch.randint(0, vocab, (32,), generator=g)
    with _LiveBigTensors(chunk * vocab) as mode:
        logp, ent = chunked_log_probs(h, w, t, chunk=chunk, with_entropy=with_entropy)
        (logp.sum() + (ent.sum() if with_entropy else 0)).backward()
    # the [vocab, hidden] head gradient (fp32) and one chunk's product (bf16) are as large as a chunk here
    head = vocab * 16 * (4 + 2)
    assert 0 < mode.peak <= LOGIT_BUFFERS * chunk * vocab * 4 + head
    assert mode.peak > (LOGIT_BUFFERS - 1) * chunk * vocab * 4  # the bound is tight, not loose by a buffer


def _seqs(random_seqs, n=5):
    seqs = random_seqs(n, 300)
    g = torch.Generator().manual_seed(3)
    for s in seqs:
        s.advantages = torch.randn(s.response_len, generator=g)
    return seqs


def test_forward_log_probs_fused_equals_full_logits(dev_model_path, random_seqs) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(dev_model_path, dtype=torch.float32)
    plain = copy.deepcopy(model)
    seqs = _seqs(random_seqs)
    logp, ent = forward_log_probs(model, seqs, 0.9, torch.device("cpu"), with_entropy=True, chunk_tokens=8)
    assert isinstance(model.lm_head, LogProbHead) and model.lm_head.request is None
    # reference: one packed row, position ids restarting per sequence (transformers' block-diagonal mask)
    ids = torch.tensor([i for s in seqs for i in s.input_ids])[None]
    pos = torch.cat([torch.arange(s.num_tokens) for s in seqs])[None]
    starts = torch.tensor([0, *[s.num_tokens for s in seqs]]).cumsum(0)
    rows = torch.cat([torch.arange(o + s.prompt_len - 1, o + s.num_tokens - 1) for o, s in zip(starts, seqs)])
    z = plain(input_ids=ids, position_ids=pos, use_cache=False).logits[0][rows].float() / 0.9
    ref = z.log_softmax(-1).gather(-1, ids[0, rows + 1][:, None]).squeeze(-1)
    assert_close(torch.cat(logp), ref, rtol=1e-5, atol=1e-5)
    # entropy sums over the whole vocabulary: fp32 summation order (padded vs packed attention) moves it ~1e-5
    assert_close(torch.cat(ent), entropy_from_logits(z), rtol=1e-4, atol=5e-5)
    torch.cat(logp).sum().backward()
    ref.sum().backward()
    for (n, a), (_, b) in zip(model.named_parameters(), plain.named_parameters()):
        assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5 * float(b.grad.abs().max()), msg=n)
    # outside forward_log_probs the head is an ordinary lm_head
    assert_close(model(input_ids=ids).logits, plain(input_ids=ids).logits)


def test_update_without_old_log_probs_equals_ratio_one(dev_model_path, random_seqs) -> None:
    from transformers import AutoModelForCausalLM

    from verl_agent.config import ActorConfig

    cfg = ActorConfig(grad_clip=100.0, entropy_coeff=0.01)
    a = AutoModelForCausalLM.from_pretrained(dev_model_path, dtype=torch.float32)
    b = copy.deepcopy(a)
    seqs_a, seqs_b = _seqs(random_seqs), _seqs(random_seqs)
    with torch.no_grad():
        old, _ = forward_log_probs(b, seqs_b, 1.0, torch.device("cpu"))
    for s, lp in zip(seqs_b, old):
        s.old_log_probs = lp
    assert all(s.old_log_probs is None for s in seqs_a)
    mb = MicroBatching(dynamic=True, max_tokens=40)  # several micro-batches
    out = []
    for model, seqs in ((a, seqs_a), (b, seqs_b)):
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)  # linear in the gradient (Adam would amplify rounding)
        out.append(update_actor(model, opt, seqs, cfg, 1.0, torch.device("cpu"), 1, mb, loss_scale_factor=256))
    assert out[0]["grad_norm"] == pytest.approx(out[1]["grad_norm"], rel=1e-5)
    assert out[0]["pg_loss"] == pytest.approx(out[1]["pg_loss"], rel=1e-4, abs=1e-6)  # ratio 1 up to rounding
    assert out[0]["ppo_kl"] == 0.0
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_rollout_correction_inside_the_update_equals_a_log_prob_pass(dev_model_path, random_seqs, level) -> None:
    """Async modes on the shortcut: the update weighs pi_old / pi_engine itself, from its own forward; same
    parameters and the same rollout_is/* metrics as a separate log-prob pass + prepare.apply_rollout_correction."""
    from transformers import AutoModelForCausalLM

    from verl_agent.config import ActorConfig
    from verl_agent.trainer.policy.prepare import apply_rollout_correction

    cfg = ActorConfig(grad_clip=100.0)
    a = AutoModelForCausalLM.from_pretrained(dev_model_path, dtype=torch.float32)
    b = copy.deepcopy(a)
    seqs_a, seqs_b = _seqs(random_seqs), _seqs(random_seqs)
    with torch.no_grad():
        old, _ = forward_log_probs(b, seqs_b, 1.0, torch.device("cpu"))
    g = torch.Generator().manual_seed(5)
    for sa, sb, lp in zip(seqs_a, seqs_b, old):  # an engine one version behind: log-probs off by up to 0.3
        sa.rollout_log_probs = sb.rollout_log_probs = lp + 0.3 * (torch.rand(lp.shape, generator=g) - 0.5)
        sb.old_log_probs = lp
    threshold = 1.05 if level == "token" else 1.0  # some weights capped, not all
    expected = apply_rollout_correction(seqs_b, level, threshold)
    assert 0 < expected["rollout_is/capped_fraction"] < 1
    mb = MicroBatching(dynamic=True, max_tokens=40)
    out = []
    for model, seqs, is_arg in ((a, seqs_a, (level, threshold)), (b, seqs_b, None)):
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        out.append(update_actor(model, opt, seqs, cfg, 1.0, torch.device("cpu"), 1, mb, loss_scale_factor=256,
                                rollout_is=is_arg))
    for key, value in expected.items():
        assert out[0][key] == pytest.approx(value, rel=1e-5), key
    assert out[0]["grad_norm"] == pytest.approx(out[1]["grad_norm"], rel=1e-5)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert_close(p, q, rtol=1e-5, atol=1e-6, msg=n)
