"""Losses against hand-computed cases, masked-token gradients and micro-batch invariance."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from verl_agent.trainer.algorithms import (
    LOSS_AGG_MODES, POLICY_LOSSES, actor_loss, agg_loss, compute_policy_loss, entropy_from_logits,
    kl_penalty, value_loss,
)

T = torch.tensor


# ---------------------------------------------------------------- aggregation


@pytest.mark.parametrize("mode, expected", [
    ("token-mean", 4.0),                   # (1 + 4 + 5 + 6) / 4
    ("seq-mean-token-sum", 8.0),           # (1 + 15) / 2
    ("seq-mean-token-mean", 3.0),          # (1/1 + 15/3) / 2
    ("seq-mean-token-sum-norm", 16 / 6),   # (1/3 + 15/3) / 2
])
def test_agg_loss_modes(mode: str, expected: float) -> None:
    # row 2 has no model token (e.g. a filtered group): it counts in no mean; its nan never leaks
    loss = T([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [float("nan")] * 3], requires_grad=True)
    mask = T([[1, 0, 0], [1, 1, 1], [0, 0, 0]])
    out = agg_loss(loss, mask, mode)
    assert out.item() == pytest.approx(expected)
    out.backward()
    assert torch.all(loss.grad[mask == 0] == 0)


def test_agg_loss_unknown_mode_and_empty_batch() -> None:
    with pytest.raises(ValueError, match="unknown loss_agg_mode 'mean'"):
        agg_loss(torch.zeros(1, 2), torch.ones(1, 2), "mean")
    for mode in LOSS_AGG_MODES:
        assert agg_loss(torch.ones(2, 2), torch.zeros(2, 2), mode).item() == 0.0  # 0, not nan
    with pytest.raises(ValueError, match="loss_mat has shape"):
        agg_loss(torch.zeros(1, 3), torch.ones(1, 2))


# ---------------------------------------------------------------- KL and entropy


@pytest.mark.parametrize("kind, p_gt_q, p_lt_q", [
    # p = .5, q = .25: d = log p - log q = ln 2 = .693147;   p = .25, q = .5: d = -ln 2
    ("k1", math.log(2), -math.log(2)),
    ("kl", math.log(2), -math.log(2)),
    ("abs", math.log(2), math.log(2)),
    ("k2", 0.5 * math.log(2) ** 2, 0.5 * math.log(2) ** 2),           # .240227
    ("mse", 0.5 * math.log(2) ** 2, 0.5 * math.log(2) ** 2),
    ("low_var_kl", 0.5 + math.log(2) - 1, 2 - math.log(2) - 1),       # q/p - log(q/p) - 1: .193147, .306853
    ("k3", 0.5 + math.log(2) - 1, 2 - math.log(2) - 1),
])
def test_kl_penalty_by_hand(kind: str, p_gt_q: float, p_lt_q: float) -> None:
    lp, ref = T([math.log(0.5), math.log(0.25)]), T([math.log(0.25), math.log(0.5)])
    assert_close(kl_penalty(lp, ref, kind), T([p_gt_q, p_lt_q]))


def test_low_var_kl_is_clamped_and_plus_uses_k2_gradient() -> None:
    # log(q/p) = -50 -> clamped to -20: e^-20 + 20 - 1 = 19.0 -> clamped to 10
    assert kl_penalty(T([0.0]), T([-50.0]), "low_var_kl").item() == 10.0
    lp = T([math.log(0.5)], requires_grad=True)
    out = kl_penalty(lp, T([math.log(0.25)]), "k3+")
    assert out.item() == pytest.approx(0.5 + math.log(2) - 1)  # value of k3
    out.backward()
    assert lp.grad.item() == pytest.approx(math.log(2))  # gradient of k2 = d
    with pytest.raises(ValueError, match="unknown kl penalty 'full'"):
        kl_penalty(lp, lp, "full")


def test_entropy_from_logits() -> None:
    # uniform over 4: ln 4; probs [.5, .25, .25]: .5 ln 2 + 2 * .25 ln 4 = 1.5 ln 2 = 1.039721; huge logit: ~0, finite
    logits = T([[0.0, 0.0, 0.0, 0.0], [math.log(0.5), math.log(0.25), math.log(0.25), -1e4], [1e4, 0, 0, 0]])
    assert_close(entropy_from_logits(logits), T([math.log(4), 1.5 * math.log(2), 0.0]), atol=1e-5, rtol=0)


# ---------------------------------------------------------------- vanilla PPO


RATIOS = [1.5, 0.5, 1.1, 0.5, 1.5, 4.0, 50.0]
ADVS = [1.0, -1.0, 1.0, 1.0, -1.0, -1.0, 9.0]
MASK = [1, 1, 1, 1, 1, 1, 0]  # the last token is a tool token with wild values


def _ppo(clip_ratio_c: float | None = 3.0):
    old = torch.zeros(1, 7)
    lp = torch.log(T([RATIOS])).requires_grad_()
    loss, metrics = compute_policy_loss("vanilla", old, lp, T([ADVS]), T([MASK]), clip_ratio_low=0.2,
                                        clip_ratio_high=0.28, clip_ratio_c=clip_ratio_c, loss_agg_mode="token-mean")
    loss.backward()
    return loss, metrics, lp.grad


def test_ppo_clip_both_sides_and_dual_clip() -> None:
    # per token (clip 1-.2 / 1+.28, dual clip c = 3), loss = max(-A r, -A clip(r)):
    #  0: r 1.5, A+1: max(-1.5, -1.28) = -1.28   clipped high, grad 0
    #  1: r .5,  A-1: max(.5, .8)     =  .8      clipped low,  grad 0
    #  2: r 1.1, A+1: max(-1.1, -1.1) = -1.1     inside,       grad -A r = -1.1
    #  3: r .5,  A+1: max(-.5, -.8)   = -.5      no clip below 1-eps for A>0, grad -.5
    #  4: r 1.5, A-1: max(1.5, 1.28)  = 1.5 ; min(1.5, 3) = 1.5   grad -A r = 1.5
    #  5: r 4,   A-1: max(4, 1.28)    = 4   ; min(4, 3)   = 3     dual clipped, grad 0
    # token-mean over 6 model tokens: (-1.28 + .8 - 1.1 - .5 + 1.5 + 3) / 6 = 2.42 / 6
    loss, m, grad = _ppo()
    assert loss.item() == pytest.approx(2.42 / 6, abs=1e-6)
    assert_close(grad, T([[0, 0, -1.1 / 6, -0.5 / 6, 1.5 / 6, 0, 0]]))
    assert m["pg_clipfrac"].item() == pytest.approx(2 / 6)  # tokens 0 and 1
    assert m["pg_clipfrac_lower"].item() == pytest.approx(1 / 6)  # token 5
    assert m["ppo_kl"].item() == pytest.approx(-sum(math.log(r) for r in RATIOS[:6]) / 6, abs=1e-6)


def test_ppo_without_dual_clip() -> None:
    # token 5 keeps its unbounded loss 4 and its gradient -A r = 4
    loss, m, grad = _ppo(clip_ratio_c=None)
    assert loss.item() == pytest.approx(3.42 / 6, abs=1e-6)
    assert grad[0, 5].item() == pytest.approx(4 / 6)
    assert m["pg_clipfrac_lower"].item() == 0.0


def test_ppo_bad_clip_settings() -> None:
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="clip_ratio_c .* must be > 1.0"):
        compute_policy_loss("vanilla", x, x, x, x, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=0.5,
                            loss_agg_mode="token-mean")
    with pytest.raises(ValueError, match="policy_loss.loss_mode: unknown policy loss 'ppo'; registered: gspo, vanilla"):
        compute_policy_loss("ppo", x, x, x, x)
    with pytest.raises(ValueError, match="advantages has shape"):
        compute_policy_loss("vanilla", x, x, torch.zeros(2, 2), x)


# ---------------------------------------------------------------- GSPO


def test_gspo_sequence_ratio_and_gradient() -> None:
    # seq 0: model log-ratios [.1, .3] around a tool token (junk 5.0): s = exp(.2) = 1.221403 < 1 + .28: unclipped
    # seq 1: log-ratios [.5, .5, .5]: s = exp(.5) = 1.648721 -> clipped to 1.28 (A > 0)
    # seq-mean-token-mean: (-1.221403 + -1.28) / 2 = -1.2507015
    # grad on seq 0 tokens: -A s / 2 tokens / 2 seqs = -.305351; seq 1 clipped: 0
    lp = T([[0.1, 5.0, 0.3, 0.0], [0.5, 0.5, 0.5, 0.0]], requires_grad=True)
    mask = T([[1, 0, 1, 0], [1, 1, 1, 0]])
    adv = torch.where(mask.bool(), 1.0, 0.0)
    loss, m = compute_policy_loss("gspo", torch.zeros(2, 4), lp, adv, mask, clip_ratio_low=0.2,
                                  clip_ratio_high=0.28, clip_ratio_c=None, loss_agg_mode="seq-mean-token-mean")
    assert loss.item() == pytest.approx(-(math.exp(0.2) + 1.28) / 2, abs=1e-6)
    loss.backward()
    g = -math.exp(0.2) / 4
    assert_close(lp.grad, T([[g, 0, g, 0], [0, 0, 0, 0]]))
    assert m["pg_clipfrac"].item() == pytest.approx(3 / 5)
    assert m["ppo_kl"].item() == pytest.approx(-(0.1 + 0.3 + 1.5) / 5)


def test_gspo_gradient_equals_the_papers_sequence_objective() -> None:
    # unclipped: d/dlp of mean_i(-A_i exp(mean_t(lp - old))) computed directly
    g = torch.Generator().manual_seed(1)
    mask = T([[1, 1, 0, 1], [1, 1, 1, 1], [0, 1, 1, 0]])
    old = torch.randn(3, 4, generator=g) * 0.01
    lp = (old + torch.randn(3, 4, generator=g) * 0.01).requires_grad_()
    adv = T([0.7, -1.2, 0.4]).unsqueeze(-1) * mask
    loss, _ = compute_policy_loss("gspo", old, lp, adv, mask, clip_ratio_low=0.9, clip_ratio_high=9.0,
                                  clip_ratio_c=None, loss_agg_mode="seq-mean-token-mean")
    (ours,) = torch.autograd.grad(loss, lp)
    s = torch.exp(((lp - old) * mask).sum(-1) / mask.sum(-1))
    (ref,) = torch.autograd.grad((-T([0.7, -1.2, 0.4]) * s).mean(), lp)
    assert_close(ours, ref)


# ---------------------------------------------------------------- critic


def test_value_loss_clipped() -> None:
    # tok0: v 1, old .5 -> clipped v .7; (1-2)^2 = 1 vs (.7-2)^2 = 1.69 -> 1.69 (clipped branch, grad 0)
    # tok1: v 2, old .5 -> clipped .7;   (2-0)^2 = 4 vs (.7-0)^2 = .49 -> 4, grad .5 * 2 (2 - 0) / 2 = 1
    # tok2: tool token, ignored.  loss = .5 * (1.69 + 4) / 2 = 1.4225
    v = T([[1.0, 2.0, 99.0]], requires_grad=True)
    loss, m = value_loss(v, T([[0.5, 0.5, 0.0]]), T([[2.0, 0.0, -99.0]]), T([[1, 1, 0]]), 0.2, "token-mean")
    assert loss.item() == pytest.approx(1.4225)
    assert m["vf_clipfrac"].item() == pytest.approx(0.5)
    loss.backward()
    assert_close(v.grad, T([[0.0, 1.0, 0.0]]))
    plain, _ = value_loss(v, T([[0.5, 0.5, 0.0]]), T([[2.0, 0.0, -99.0]]), T([[1, 1, 0]]), None)
    assert plain.item() == pytest.approx(0.5 * (1 + 4) / 2)


# ---------------------------------------------------------------- the whole actor objective


def test_actor_loss_combines_pg_entropy_and_kl() -> None:
    # ratio 1 (old == new): pg = -mean(A) = -(1 + 3)/2 = -2
    # entropy mean (.5 + 1.5)/2 = 1 -> -0.01 * 1 ; k1 kl mean ((0 - -.2) + (0 - -.4))/2 = .3 -> +0.1 * .3
    lp = torch.zeros(1, 3)
    loss, m = actor_loss(lp, lp, T([[1.0, 5.0, 3.0]]), T([[1, 0, 1]]), entropy=T([[0.5, 9.0, 1.5]]),
                         entropy_coeff=0.01, ref_log_prob=T([[-0.2, 0.0, -0.4]]), kl_loss_coef=0.1,
                         kl_loss_type="k1")
    assert loss.item() == pytest.approx(-2 - 0.01 + 0.03)
    assert m["pg_loss"].item() == pytest.approx(-2) and m["entropy"].item() == pytest.approx(1)
    assert m["kl_loss"].item() == pytest.approx(0.3)
    with pytest.raises(ValueError, match="needs ref_log_prob"):
        actor_loss(lp, lp, lp, lp, kl_loss_coef=0.1)
    with pytest.raises(ValueError, match="needs the per-token entropy"):
        actor_loss(lp, lp, lp, lp, entropy_coeff=0.1)


@pytest.mark.parametrize("loss_mode", sorted(POLICY_LOSSES))
@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_masked_tokens_get_zero_gradient_and_do_not_change_the_loss(loss_mode: str, mode: str) -> None:
    g = torch.Generator().manual_seed(2)
    mask = T([[1, 1, 0, 0, 1, 0], [0, 1, 1, 1, 0, 0]])  # tool tokens mid-sequence, padding at the end
    lp = (torch.randn(2, 6, generator=g) * 0.1).requires_grad_()
    clean = dict(old=lp.detach() + 0.05, adv=torch.randn(2, 6, generator=g), ent=torch.rand(2, 6, generator=g),
                 ref=lp.detach() - 0.1)
    junk = {k: torch.where(mask.bool(), v, 1e4) for k, v in clean.items()}  # wild values off the mask

    def run(x):
        return actor_loss(x["old"], lp, x["adv"], mask, loss_mode=loss_mode, loss_agg_mode=mode,
                          entropy=x["ent"], entropy_coeff=0.01, ref_log_prob=x["ref"], kl_loss_coef=0.1)[0]

    a, b = run(clean), run(junk)
    assert_close(a, b)
    (grad,) = torch.autograd.grad(b, lp)
    assert torch.all(grad[mask == 0] == 0) and torch.all(grad[mask == 1] != 0)


# ---------------------------------------------------------------- invariance: micro-batches == one batch


@pytest.mark.parametrize("loss_mode, mode", [("vanilla", "token-mean"), ("vanilla", "seq-mean-token-sum"),
                                             ("gspo", "seq-mean-token-mean"), ("vanilla", "seq-mean-token-sum-norm")])
def test_micro_batches_with_global_counts_equal_one_batch(loss_mode: str, mode: str) -> None:
    """Summed micro-batch losses (actor and critic) with the step's global counts and the constant
    loss_scale_factor equal the full batch's loss, although each micro-batch is padded only to its own
    longest response (widths 7, 2 and 7 here, 7 for the full batch), as the trainer pads them."""
    # a tiny policy: logits = W x, value = first logit
    g = torch.Generator().manual_seed(3)
    B, L, V, H = 6, 7, 5, 4
    feats = torch.randn(B, L, H, generator=g)
    tokens = torch.randint(0, V, (B, L), generator=g)
    lens = T([3, 7, 2, 5, 7, 4])  # response lengths: the micro-batches below have different padded widths
    mask = ((torch.rand(B, L, generator=g) > 0.3) & (torch.arange(L) < lens[:, None])).float()
    mask[:, 0] = 1
    mask[0, 1:] = 0  # very uneven token counts make a naive mean of micro-batch means wrong
    adv = torch.randn(B, generator=g).unsqueeze(-1) * mask
    returns = torch.randn(B, L, generator=g)
    w = torch.nn.Linear(H, V)

    def loss_of(rows: slice, **counts):
        width = int(lens[rows].max())  # padded to this micro-batch's longest response, as the trainer does
        x, m = feats[rows, :width], mask[rows, :width]
        lp = torch.log_softmax(w(x), -1).gather(-1, tokens[rows, :width, None]).squeeze(-1)
        ent = entropy_from_logits(w(x))
        actor = actor_loss(lp.detach() + 0.03, lp, adv[rows, :width], m, loss_mode=loss_mode, loss_agg_mode=mode,
                           clip_ratio_low=0.2, clip_ratio_high=0.28, entropy=ent, entropy_coeff=0.01,
                           ref_log_prob=lp.detach() - 0.02, kl_loss_coef=0.1, **counts)[0]
        v = w(x)[..., 0]
        critic = value_loss(v, v.detach() + 0.1, returns[rows, :width], m, 0.5, mode, **counts)[0]
        return actor + critic

    norm = {"loss_scale_factor": 10}  # data.max_response_length: larger than any width here
    full = torch.autograd.grad(loss_of(slice(0, B), **norm), list(w.parameters()))
    counts = {"global_token_count": mask.sum(), "global_seq_count": B, **norm}
    acc = [torch.zeros_like(p) for p in w.parameters()]
    naive = [torch.zeros_like(p) for p in w.parameters()]
    for rows in (slice(0, 2), slice(2, 3), slice(3, B)):
        for a, gr in zip(acc, torch.autograd.grad(loss_of(rows, **counts), list(w.parameters()))):
            a += gr
        for a, gr in zip(naive, torch.autograd.grad(loss_of(rows, **norm) / 3, list(w.parameters()))):
            a += gr
    for a, f in zip(acc, full):
        assert_close(a, f, atol=1e-6, rtol=1e-5)
    assert any(not torch.allclose(n, f, atol=1e-4) for n, f in zip(naive, full))


def test_dr_grpo_divides_by_the_constant_not_the_padded_width() -> None:
    """seq-mean-token-sum-norm divides each sequence's token sum by loss_scale_factor (data.max_response_length):
    the same per-sequence loss whatever width its micro-batch was padded to; without it, by the width."""
    short = T([[1.0, 1.0, 0.0, 0.0]])  # a 2-token response, alone (width 2) or padded beside a 4-token one
    mask = T([[1, 1, 0, 0]])
    alone = agg_loss(short[:, :2], mask[:, :2], "seq-mean-token-sum-norm", global_seq_count=1, loss_scale_factor=8)
    padded = agg_loss(short, mask, "seq-mean-token-sum-norm", global_seq_count=1, loss_scale_factor=8)
    assert alone.item() == padded.item() == pytest.approx(2 / 8)
    assert agg_loss(short, mask, "seq-mean-token-sum-norm").item() == pytest.approx(2 / 4)  # verl's default: T
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):  # the other modes ignore it
        assert agg_loss(short, mask, mode, loss_scale_factor=8).item() == agg_loss(short, mask, mode).item()
