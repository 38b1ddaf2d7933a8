"""Advantage estimators against small cases worked out by hand (arithmetic in the comments)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from verl_agent.trainer.algorithms import (
    ADV_ESTIMATORS, apply_kl_in_reward, compute_advantages, filter_uniform_groups, group_ids_from_index,
    masked_whiten, register_adv_estimator, scores_to_token_rewards,
)

T = torch.tensor


def _whiten_by_hand(xs: list[float]) -> list[float]:
    mean = sum(xs) / len(xs)
    var = sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)  # unbiased, as verl
    return [(x - mean) / math.sqrt(var + 1e-8) for x in xs]


# ---------------------------------------------------------------- GRPO / Dr. GRPO


def test_grpo_group_normalised_and_broadcast_on_model_tokens_only() -> None:
    # group "a" = [1, 0, 0]: mean 1/3, unbiased std = sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3) = 0.57735
    #   -> (1 - 1/3) / 0.57735 = 1.15470, (0 - 1/3) / 0.57735 = -0.57735
    # group "b" = [2, 2]: all equal -> 0
    scores = T([1.0, 0.0, 0.0, 2.0, 2.0])
    mask = T([[1, 1, 0, 1], [1, 0, 0, 0], [1, 1, 1, 1], [1, 1, 0, 0], [0, 1, 1, 0]])  # row 0: tool gap at 2
    adv, ret = compute_advantages("grpo", scores=scores, response_mask=mask, group_index=["a", "a", "a", "b", "b"])
    a, b = 2 / 3 / math.sqrt(1 / 3), -1 / 3 / math.sqrt(1 / 3)
    expected = T([[a, a, 0, a], [b, 0, 0, 0], [b, b, b, b], [0, 0, 0, 0], [0, 0, 0, 0]])
    assert_close(adv, expected, atol=1e-5, rtol=0)
    assert_close(ret, adv)
    assert a == pytest.approx(1.154700, abs=1e-6) and b == pytest.approx(-0.577350, abs=1e-6)


def test_dr_grpo_drops_the_std_division() -> None:
    # same group [1, 0, 0]: s - mean = [2/3, -1/3, -1/3], no division
    mask = torch.ones(3, 2)
    adv, _ = compute_advantages("grpo", scores=T([1.0, 0.0, 0.0]), response_mask=mask,
                                group_index=T([7, 7, 7]), norm_adv_by_std_in_grpo=False)
    assert_close(adv, T([[2 / 3] * 2, [-1 / 3] * 2, [-1 / 3] * 2]))
    # GRPO = Dr. GRPO / (std + eps): the ratio is 1 / 0.57735 for every token
    grpo, _ = compute_advantages("grpo", scores=T([1.0, 0.0, 0.0]), response_mask=mask, group_index=T([7, 7, 7]))
    assert_close(grpo, adv / (math.sqrt(1 / 3) + 1e-6))


def test_grpo_singleton_group_keeps_score_as_verl() -> None:
    # a group of one has mean 0, std 1 (verl): adv = 0.7 / (1 + 1e-6)
    adv, _ = compute_advantages("grpo", scores=T([0.7]), response_mask=T([[1, 1]]), group_index=["x"])
    assert_close(adv, T([[0.7, 0.7]]) / (1 + 1e-6))


def test_grpo_groups_need_not_be_contiguous_and_uids_or_tensor_agree() -> None:
    scores = T([1.0, 5.0, 0.0, 3.0])  # groups: {0, 2} -> [1, 0], {1, 3} -> [5, 3]
    mask = torch.ones(4, 1)
    by_str, _ = compute_advantages("grpo", scores=scores, response_mask=mask, group_index=["p", "q", "p", "q"])
    by_int, _ = compute_advantages("grpo", scores=scores, response_mask=mask, group_index=T([10, 3, 10, 3]))
    # [1, 0]: mean .5, std sqrt(.5) = .70711 -> +-0.70711; [5, 3]: mean 4, std sqrt(2) -> +-0.70711
    s = 0.5 / math.sqrt(0.5)
    assert_close(by_str, T([[s], [s], [-s], [-s]]), atol=1e-5, rtol=0)
    assert_close(by_int, by_str)
    assert group_ids_from_index(["p", "q", "p"], 3).tolist() == [0, 1, 0]


# ---------------------------------------------------------------- RLOO


def test_rloo_leave_one_out_on_three_members() -> None:
    # scores [1, 0, 0.5]: adv_i = s_i - mean(others)
    #   1   - (0 + 0.5)/2 =  0.75
    #   0   - (1 + 0.5)/2 = -0.75
    #   0.5 - (1 + 0)/2   =  0.0
    mask = T([[1, 0, 1], [1, 1, 1], [0, 0, 1]])
    adv, ret = compute_advantages("rloo", scores=T([1.0, 0.0, 0.5]), response_mask=mask, group_index=[0, 0, 0])
    assert_close(adv, T([[0.75, 0, 0.75], [-0.75, -0.75, -0.75], [0, 0, 0]]))
    assert_close(ret, adv)


def test_rloo_singleton_is_the_score() -> None:
    adv, _ = compute_advantages("rloo", scores=T([0.25]), response_mask=T([[1]]), group_index=["solo"])
    assert_close(adv, T([[0.25]]))


# ---------------------------------------------------------------- GAE


def test_gae_four_model_steps_across_a_tool_gap() -> None:
    # model tokens at positions 0, 1, 4, 5; a tool response at 2-3 (mask 0) whose values are junk (100).
    # time axis = model tokens only: r = [0, 0, 0, 1], V = [.5, .6, .7, .8], gamma .9, lam .8 (gamma*lam = .72)
    #   t3: delta = 1 - .8                = .2    A3 = .2
    #   t2: delta = .9*.8 - .7            = .02   A2 = .02 + .72*.2     = .164
    #   t1: delta = .9*.7 - .6            = .03   A1 = .03 + .72*.164   = .14808
    #   t0: delta = .9*.6 - .5            = .04   A0 = .04 + .72*.14808 = .1466176
    # returns = A + V = [.6466176, .74808, .864, 1.0]
    mask = T([[1, 1, 0, 0, 1, 1]])
    rewards = T([[0, 0, 0, 0, 0, 1.0]])
    values = T([[0.5, 0.6, 100.0, 100.0, 0.7, 0.8]])
    adv, ret = compute_advantages("gae", token_rewards=rewards, response_mask=mask, values=values, gamma=0.9, lam=0.8)
    assert_close(ret, T([[0.6466176, 0.74808, 0, 0, 0.864, 1.0]]))
    w = _whiten_by_hand([0.1466176, 0.14808, 0.164, 0.2])
    assert_close(adv, T([[w[0], w[1], 0, 0, w[2], w[3]]]), atol=1e-5, rtol=0)


def test_gae_gamma_lam_one_gives_monte_carlo_return_and_row_ends_are_terminal() -> None:
    # gamma = lam = 1: A_t = sum of deltas = R - V_t, so returns = R = 1 on every model token of row 0;
    # row 1 is shorter (ends at position 1) and its own reward 2 must not bleed into row 0 or past its end.
    mask = T([[1, 0, 1, 1], [1, 1, 0, 0]])
    rewards = T([[0, 0, 0, 1.0], [0, 2.0, 0, 0]])
    values = T([[0.3, 9, 0.1, 0.9], [0.5, 1.5, 9, 9]])
    _, ret = compute_advantages("gae", token_rewards=rewards, response_mask=mask, values=values)
    assert_close(ret, T([[1.0, 0, 1.0, 1.0], [2.0, 2.0, 0, 0]]))


def test_gae_reward_on_tool_token_is_credited_to_the_model_token_before() -> None:
    # a tool reward .5 at position 2 (mask 0) belongs to the action at position 1; V = 0, gamma = lam = 1:
    # packed r = [0, .5, 0, 1] -> returns-to-go [1.5, 1.5, 1, 1]
    mask = T([[1, 1, 0, 0, 1, 1]])
    rewards = T([[0, 0, 0.5, 0, 0, 1.0]])
    _, ret = compute_advantages("gae", token_rewards=rewards, response_mask=mask, values=torch.zeros(1, 6))
    assert_close(ret, T([[1.5, 1.5, 0, 0, 1.0, 1.0]]))


def test_reward_before_first_model_token_is_an_error() -> None:
    with pytest.raises(ValueError, match="row 1 .*before its first model token"):
        compute_advantages("reinforce_plus_plus", token_rewards=T([[0, 1.0], [1.0, 0]]),
                           response_mask=T([[1, 1], [0, 1]]))


def test_gae_needs_values() -> None:
    with pytest.raises(ValueError, match="needs values"):
        compute_advantages("gae", token_rewards=torch.zeros(1, 2), response_mask=torch.ones(1, 2))


# ---------------------------------------------------------------- REINFORCE++


def test_reinforce_plus_plus_discounts_over_model_tokens_then_whitens() -> None:
    # mask [1, 0, 1, 1], reward 1 on the last token, gamma .5: returns-to-go on model tokens = [.25, .5, 1]
    # whiten: mean .583333, unbiased var = (.111111 + .006944 + .173611)/2 = .145833 -> [-.87287, -.21822, 1.09109]
    adv, ret = compute_advantages("reinforce_plus_plus", token_rewards=T([[0, 0, 0, 1.0]]),
                                  response_mask=T([[1, 0, 1, 1]]), gamma=0.5)
    assert_close(ret, T([[0.25, 0, 0.5, 1.0]]))
    assert_close(adv, T([[-0.87287, 0, -0.21822, 1.09109]]), atol=1e-5, rtol=0)


def test_reinforce_plus_plus_baseline_subtracts_group_mean_then_whitens_over_batch() -> None:
    # groups [1, 0] and [1, 1] -> s - mean = [.5, -.5, 0, 0]; broadcast on masks -> 6 tokens [.5, .5, -.5, 0, 0, 0]
    # whiten over them: mean = .5/6 = 1/12; deviations [5/12, 5/12, -7/12, -1/12 x3];
    # unbiased var = (25 + 25 + 49 + 3) / 144 / 5 = 102/720 = .141667
    mask = T([[1, 1], [1, 0], [1, 1], [0, 1]])
    adv, _ = compute_advantages("reinforce_plus_plus_baseline", scores=T([1.0, 0.0, 1.0, 1.0]),
                                response_mask=mask, group_index=[0, 0, 1, 1])
    d = 1 / 12 / math.sqrt(102 / 720 + 1e-8)
    assert_close(adv, T([[5 * d, 5 * d], [-7 * d, 0], [-d, -d], [0, -d]]))


# ---------------------------------------------------------------- helpers and contracts


def test_scores_and_token_rewards_inputs_agree() -> None:
    mask = T([[1, 1, 0], [0, 1, 1], [0, 0, 0]])
    scores = T([0.5, -1.0, 3.0])
    tr = scores_to_token_rewards(scores, mask)
    assert_close(tr, T([[0, 0.5, 0], [0, 0, -1.0], [0, 0, 0]]))  # last model token; row without one: dropped
    for name in ("grpo", "rloo", "reinforce_plus_plus_baseline"):
        a1, _ = compute_advantages(name, scores=scores[:2], response_mask=mask[:2], group_index=[0, 0])
        a2, _ = compute_advantages(name, token_rewards=tr[:2], response_mask=mask[:2], group_index=[0, 0])
        assert_close(a1, a2)


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae"])
def test_every_estimator_is_zero_off_the_mask(name: str) -> None:
    g = torch.Generator().manual_seed(0)
    mask = (torch.rand(6, 9, generator=g) > 0.4).float()
    mask[:, 0] = 1
    scores = torch.rand(6, generator=g)
    adv, ret = compute_advantages(name, scores=scores, response_mask=mask, group_index=[0, 0, 0, 1, 1, 1],
                                  values=torch.randn(6, 9, generator=g) * 50, gamma=0.99, lam=0.95)
    assert adv.shape == ret.shape == mask.shape
    assert torch.all(adv[mask == 0] == 0) and torch.all(ret[mask == 0] == 0)
    assert torch.isfinite(adv).all()


def test_masked_whiten_ignores_masked_values() -> None:
    x = T([[1.0, 1e6, 2.0, 3.0]])
    out = masked_whiten(x, T([[1, 0, 1, 1]]))
    assert_close(out, T([[-1.0, 0, 0, 1.0]]), atol=1e-5, rtol=0)  # [1, 2, 3]: mean 2, unbiased std 1


def test_errors_name_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="algorithm.adv_estimator: unknown advantage estimator 'ppo'; registered: gae, gigpo, grpo"):
        compute_advantages("ppo", scores=T([1.0]), response_mask=T([[1]]))
    with pytest.raises(ValueError, match="'grpo' needs group_index"):
        compute_advantages("grpo", scores=T([1.0]), response_mask=T([[1]]))
    with pytest.raises(ValueError, match="scores must have shape"):
        compute_advantages("grpo", scores=T([1.0, 2.0]), response_mask=T([[1]]), group_index=[0])
    with pytest.raises(ValueError, match="group_index has 1 entries for a batch of 2"):
        compute_advantages("grpo", scores=T([1.0, 2.0]), response_mask=torch.ones(2, 1), group_index=[0])
    with pytest.raises(ValueError, match="group_index must be a 1-d tensor"):
        compute_advantages("grpo", scores=T([1.0]), response_mask=T([[1]]), group_index=T([[0]]))
    with pytest.raises(ValueError, match="token_rewards or scores|token_rewards \\[B, T\\] or scores"):
        compute_advantages("rloo", response_mask=T([[1]]), group_index=[0])


def test_register_custom_estimator() -> None:
    @register_adv_estimator("test_constant")
    def constant(inp):  # noqa: ANN001, ANN202
        return inp.response_mask.float() * 2, inp.response_mask.float()

    try:
        adv, _ = compute_advantages("test_constant", scores=T([0.0]), response_mask=T([[1, 0]]))
        assert adv.tolist() == [[2.0, 0.0]]
        with pytest.raises(ValueError, match="already registered"):
            register_adv_estimator("test_constant")(constant)
    finally:
        ADV_ESTIMATORS.unregister("test_constant")


def test_filter_uniform_groups() -> None:
    # groups: [1, 1] all equal -> drop; [0, 1] -> keep; [2] singleton -> keep; [.5, .5, .5] -> drop
    keep = filter_uniform_groups(T([1.0, 1.0, 0.0, 1.0, 2.0, 0.5, 0.5, 0.5]), ["a", "a", "b", "b", "c", "d", "d", "d"])
    assert keep.tolist() == [False, False, True, True, True, False, False, False]


def test_apply_kl_in_reward_only_on_model_tokens() -> None:
    # r - 0.1 * kl on mask 1: [0 - .1*.5, (tool: unchanged 0), 1 - .1*2] = [-.05, 0, .8]
    out = apply_kl_in_reward(T([[0.0, 0.0, 1.0]]), T([[0.5, 7.0, 2.0]]), 0.1, T([[1, 0, 1]]))
    assert_close(out, T([[-0.05, 0.0, 0.8]]))


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae"])
def test_bool_mask_and_rows_without_model_tokens(name: str) -> None:
    # a bool/int mask gives the float mask's result; an all-masked row (aborted turn) yields zeros, not nan
    mask = T([[1, 0, 1], [0, 0, 0], [1, 1, 0], [0, 1, 1]])
    kw = dict(scores=T([1.0, 0.0, 0.5, 0.2]), group_index=[0, 0, 1, 1], values=T([[0.1] * 3] * 4), gamma=0.9)
    ref, ref_ret = compute_advantages(name, response_mask=mask.float(), **kw)
    for m in (mask.bool(), mask.long()):
        adv, ret = compute_advantages(name, response_mask=m, **kw)
        assert_close(adv, ref)
        assert_close(ret, ref_ret)
    assert torch.isfinite(ref).all() and torch.all(ref[1] == 0)
    empty, _ = compute_advantages(name, response_mask=torch.zeros(2, 3), scores=T([0.0, 0.0]), group_index=[0, 0],
                                  values=torch.zeros(2, 3))
    assert torch.all(empty == 0)
