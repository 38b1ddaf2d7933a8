"""Turn-level estimators (grpo_turn, gigpo, gae with timestep_unit=turn) against values worked out by hand,
and the trainer's path from trajectories (turn scores, anchor states) to their inputs.

Sharding is simulated in one process as in test_prepare.py: `all_reduce` sums the shards' statistics
exactly as torch.distributed would.
"""

from __future__ import annotations

import math
import threading

import pytest
import torch
from torch.testing import assert_close

from verl_agent.config import AlgorithmConfig, ConfigError, load_config
from verl_agent.protocol import Trajectory, Turn
from verl_agent.trainer.algorithms.advantages import masked_whiten
from verl_agent.trainer.algorithms import compute_advantages
from verl_agent.trainer.policy.batch import from_trajectory, pad_field
from verl_agent.trainer.policy.prepare import assign_advantages, turn_index, turn_token_rewards

# Three trajectories of one prompt; positions: 2 model tokens, 1 observation token, then the next turn.
#   A: turn 0 at 0-1 (reward 0.5), observation at 2, turn 1 at 3-4 (reward 1.0)
#   B: turn 0 at 0-1 (reward 0.0), observation at 2, turn 1 at 3-4 (reward 0.0)
#   C: one turn at 0-1 (reward 1.0), padding after
MASK = torch.tensor([[1, 1, 0, 1, 1], [1, 1, 0, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.float32)
TIDX = torch.tensor([[0, 0, 0, 1, 1], [0, 0, 0, 1, 1], [0, 0, -1, -1, -1]])
REWARDS = torch.tensor([[0, 0.5, 0, 0, 1.0], [0, 0, 0, 0, 0], [0, 1.0, 0, 0, 0]])
S3 = 1 / math.sqrt(3)  # (1/3) / std of {1, 0, 1}; std = sqrt(1/3)


def per_token(row_values: list[list[float]]) -> torch.Tensor:
    """[B, T] from each row's per-turn values, spread over the turns' model tokens."""
    out = torch.zeros(MASK.shape)
    for i, vals in enumerate(row_values):
        for t in range(MASK.shape[1]):
            if MASK[i, t] and TIDX[i, t] >= 0:
                out[i, t] = vals[int(TIDX[i, t])]
    return out


def test_grpo_turn_by_hand():
    # gamma 0.5: returns A = [0.5 + 0.5 * 1.0, 1.0] = [1.0, 1.0], B = [0, 0], C = [1.0]
    # turn 0 over {A, B, C} = {1, 0, 1}: mean 2/3, std sqrt(1/3) -> A, C: +1/sqrt(3), B: -2/sqrt(3)
    # turn 1 over {A, B} = {1, 0}: mean 1/2, std sqrt(1/2) -> +-sqrt(1/2)
    adv, ret = compute_advantages("grpo_turn", response_mask=MASK, token_rewards=REWARDS, group_index=["p"] * 3,
                                  turn_index=TIDX, gamma=0.5)
    r2 = math.sqrt(0.5)
    assert_close(adv, per_token([[S3, r2], [-2 * S3, -r2], [S3]]), rtol=1e-5, atol=1e-5)
    assert_close(ret, adv)


def test_grpo_turn_equals_grpo_with_one_turn_each():
    g = torch.Generator().manual_seed(0)
    mask = (torch.rand(8, 6, generator=g) > 0.3).float()
    mask[:, 0] = 1
    rewards = torch.zeros(8, 6)
    rewards[:, 3] = torch.randn(8, generator=g)
    gids = [0, 0, 0, 1, 1, 2, 2, 2]
    for gamma in (1.0, 0.7):
        for by_std in (True, False):
            kw = dict(response_mask=mask, token_rewards=rewards, group_index=gids, gamma=gamma,
                      norm_adv_by_std_in_grpo=by_std)
            expected, _ = compute_advantages("grpo", **kw)
            got, _ = compute_advantages("grpo_turn", **kw, turn_index=torch.zeros(8, 6, dtype=torch.long))
            assert_close(got, expected)
            assert_close(compute_advantages("grpo_turn", **kw)[0], expected)  # no turn_index: one turn


def test_gigpo_by_hand():
    # episode scores A 1.5, B 0.0, C 1.0: mean 5/6, deviations 2/3, -5/6, 1/6, unbiased var 7/12
    sd = math.sqrt(7 / 12)
    ea, eb, ec = (2 / 3) / sd, (-5 / 6) / sd, (1 / 6) / sd
    # gamma 1: returns A [1.5, 1.0], B [0, 0], C [1.0]; turn 0 of all three starts from the prompt:
    # one step group {1.5, 0, 1.0} = the episode scores -> the same normalised values
    keys_differ = [["prompt", "s1"], ["prompt", "s2"], ["prompt"]]
    adv, _ = compute_advantages("gigpo", response_mask=MASK, token_rewards=REWARDS, group_index=["p"] * 3,
                                turn_index=TIDX, turn_keys=keys_differ, step_weight=0.5)
    # A's and B's second turns start from different states: groups of one, step advantage 0
    assert_close(adv, per_token([[ea + 0.5 * ea, ea], [eb + 0.5 * eb, eb], [ec + 0.5 * ec]]), rtol=1e-5, atol=1e-5)
    keys_match = [["prompt", "s"], ["prompt", "s"], ["prompt"]]
    adv, _ = compute_advantages("gigpo", response_mask=MASK, token_rewards=REWARDS, group_index=["p"] * 3,
                                turn_index=TIDX, turn_keys=keys_match, step_weight=0.5)
    r2 = math.sqrt(0.5)  # step group {A1: 1.0, B1: 0.0}
    assert_close(adv, per_token([[1.5 * ea, ea + 0.5 * r2], [1.5 * eb, eb - 0.5 * r2], [1.5 * ec]]),
                 rtol=1e-5, atol=1e-5)
    # the same keys in different prompt groups never form a step group
    adv, _ = compute_advantages("gigpo", response_mask=MASK, token_rewards=REWARDS, group_index=["p", "q", "p"],
                                turn_index=TIDX, turn_keys=keys_match, step_weight=0.5)
    assert float(adv[0, 3]) == pytest.approx(float(adv[0, 0]) / 1.5 * 1.0, abs=1e-5)  # A1: episode part only


def _episode_part(group_index, **kw) -> list[float]:
    """Each row's gigpo advantage with step_weight 0 (the episode part alone), read at its first token."""
    adv, _ = compute_advantages("gigpo", response_mask=MASK, token_rewards=REWARDS, group_index=group_index,
                                turn_index=TIDX, turn_keys=[["x", "y"], ["x", "z"], ["x"]], step_weight=0.0, **kw)
    return adv[:, 0].tolist()


def test_gigpo_episode_norm_step_by_hand():
    """The authors' code's default: one row per turn, each with its trajectory's reward (A 2 turns 1.5,
    B 2 turns 0.0, C 1 turn 1.0) -> rows {1.5, 1.5, 0, 0, 1.0}: mean 0.8, deviations 0.7, 0.7, -0.8, -0.8, 0.2,
    squares sum 2.3, unbiased var 2.3 / 4 = 0.575, std 0.7582875."""
    step = _episode_part(["p"] * 3, episode_norm="step")
    assert step == pytest.approx([0.7 / 0.7582875, -0.8 / 0.7582875, 0.2 / 0.7582875], abs=1e-5)
    assert step == pytest.approx([0.9231325, -1.0550086, 0.2637522], abs=1e-5)
    # the paper's per-trajectory formula (today's default): {1.5, 0, 1.0}, mean 5/6, var 7/12
    sd = math.sqrt(7 / 12)
    assert _episode_part(["p"] * 3) == pytest.approx([(2 / 3) / sd, (-5 / 6) / sd, (1 / 6) / sd], abs=1e-5)
    # without std (the reference's mean_norm): the deviations from the row mean 0.8
    assert _episode_part(["p"] * 3, episode_norm="step", norm_adv_by_std_in_grpo=False) == pytest.approx(
        [0.7, -0.8, 0.2], abs=1e-6)
    # the step part is added on top as before: A1 and B1 share a state here (step group {1.0, 0.0})
    adv, _ = compute_advantages("gigpo", response_mask=MASK, token_rewards=REWARDS, group_index=["p"] * 3,
                                turn_index=TIDX, turn_keys=[["x", "s"], ["x", "s"], ["x"]], step_weight=0.5,
                                episode_norm="step")
    assert float(adv[0, 3]) == pytest.approx(0.9231325 + 0.5 * math.sqrt(0.5), abs=1e-5)


def test_gigpo_singleton_groups_by_hand():
    """A alone in its group (2 turns, reward 1.5), {B, C} together; then C alone (1 turn, reward 1.0)."""
    # verl's rule on one entry: R. In step mode A has 2 equal rows: (1.5 - 1.5) / (0 + eps) = 0, as in the
    # reference code; {B, C} rows {0, 0, 1.0}: mean 1/3, var (1/9 + 1/9 + 4/9) / 2 = 1/3
    s3 = math.sqrt(1 / 3)
    assert _episode_part(["a", "bc", "bc"]) == pytest.approx([1.5, -math.sqrt(0.5), math.sqrt(0.5)], abs=1e-5)
    assert _episode_part(["a", "bc", "bc"], episode_norm="step") == pytest.approx(
        [0.0, (-1 / 3) / s3, (2 / 3) / s3], abs=1e-5)
    assert _episode_part(["a", "bc", "bc"], singleton_group="zero") == pytest.approx(
        [0.0, -math.sqrt(0.5), math.sqrt(0.5)], abs=1e-5)
    # C alone with one turn: one row in either mode, so verl's rule gives R = 1.0 (the reference too); zero: 0
    # {A, B}: trajectories {1.5, 0}: +-sqrt(1/2); step rows {1.5, 1.5, 0, 0}: mean 0.75, var 0.75
    r2, sv = math.sqrt(0.5), 0.75 / math.sqrt(0.75)
    assert _episode_part(["ab", "ab", "c"]) == pytest.approx([r2, -r2, 1.0], abs=1e-5)
    assert _episode_part(["ab", "ab", "c"], episode_norm="step") == pytest.approx([sv, -sv, 1.0], abs=1e-5)
    for norm in ("trajectory", "step"):
        assert _episode_part(["ab", "ab", "c"], episode_norm=norm, singleton_group="zero")[2] == 0.0
    with pytest.raises(ValueError, match="algorithm.gigpo.episode_norm"):
        _episode_part(["p"] * 3, episode_norm="rows")
    with pytest.raises(ValueError, match="algorithm.gigpo.singleton_group"):
        _episode_part(["p"] * 3, singleton_group="score")


def test_equal_rewards_in_a_group_give_exactly_zero():
    """Group statistics in float64: sixteen rewards of 0.7 (not exact in binary) have mean exactly 0.7, so
    GRPO gives 0, not float32 rounding noise divided by std + eps (about +-0.1). The same holds for a lone
    trajectory of several turns under episode_norm=step (rows {0.7, 0.7, 0.7})."""
    mask = torch.ones(16, 3)
    adv, _ = compute_advantages("grpo", response_mask=mask, scores=torch.full((16,), 0.7), group_index=[0] * 16)
    assert adv.abs().max().item() == 0.0
    rewards = torch.zeros(1, 9)
    rewards[0, 7] = 0.7
    adv, _ = compute_advantages("gigpo", response_mask=torch.ones(1, 9), token_rewards=rewards, group_index=["p"],
                                turn_index=torch.tensor([[0, 0, 0, 1, 1, 1, 2, 2, 2]]), turn_keys=[["a", "b", "c"]],
                                episode_norm="step")
    assert adv.abs().max().item() == 0.0


def test_gigpo_episode_options_reach_the_estimator_from_the_config():
    """Through assign_advantages: a (2 turns, 1.0), b (2 turns, 0.0), c (1 turn, 0.0); rows {1, 1, 0, 0, 0}:
    mean 0.4, deviations 0.6, 0.6, -0.4 x 3, squares sum 1.2, var 0.3."""
    seqs = [from_trajectory(hilo_traj("p", [(2, 5, 0.0, None), (2, 6, 1.0, None)], [[7]], 1.0)),
            from_trajectory(hilo_traj("p", [(2, 5, 0.0, None), (2, 6, 0.0, None)], [[7]], 0.0)),
            from_trajectory(hilo_traj("p", [(2, 5, 0.0, None)], [], 0.0))]
    algo = AlgorithmConfig(adv_estimator="gigpo", gigpo={"step_weight": 0.0, "episode_norm": "step"})
    assign_advantages(seqs, algo, 0.0)
    sd = math.sqrt(0.3)
    assert [s.advantages[0].item() for s in seqs] == pytest.approx([0.6 / sd, -0.4 / sd, -0.4 / sd], abs=1e-5)
    cfg = load_config(None, ["algorithm.adv_estimator=gigpo", "algorithm.gigpo.episode_norm=step",
                             "algorithm.gigpo.singleton_group=zero"])
    assert (cfg.algorithm.gigpo.episode_norm, cfg.algorithm.gigpo.singleton_group) == ("step", "zero")
    with pytest.raises(ConfigError, match="episode_norm"):
        load_config(None, ["algorithm.adv_estimator=gigpo", "algorithm.gigpo.episode_norm=steps"])
    with pytest.raises(ConfigError, match="algorithm.gigpo"):
        load_config(None, ["algorithm.adv_estimator=grpo", "algorithm.gigpo.singleton_group=zero"])


def test_gigpo_needs_turn_keys():
    with pytest.raises(ValueError, match="turn_keys"):
        compute_advantages("gigpo", response_mask=MASK, token_rewards=REWARDS, group_index=["p"] * 3, turn_index=TIDX)


def test_gae_over_turns_by_hand():
    # row A only: V read at each turn's first model token (0.5 at 0, 0.2 at 3); other positions ignored
    mask, tidx, rewards = MASK[:1], TIDX[:1], REWARDS[:1]
    values = torch.tensor([[0.5, 9.0, 9.0, 0.2, 9.0]])
    adv, ret = compute_advantages("gae", response_mask=mask, token_rewards=rewards, values=values,
                                  turn_index=tidx, gamma=0.9, lam=0.8, timestep_unit="turn")
    # delta1 = 1.0 + 0 - 0.2 = 0.8 = A1; delta0 = 0.5 + 0.9 * 0.2 - 0.5 = 0.18; A0 = 0.18 + 0.72 * 0.8 = 0.756
    raw = torch.tensor([[0.756, 0.756, 0.0, 0.8, 0.8]])
    assert_close(ret, torch.tensor([[1.256, 1.256, 0.0, 1.0, 1.0]]), rtol=1e-5, atol=1e-6)
    assert_close(adv, masked_whiten(raw, mask), rtol=1e-5, atol=1e-6)


def hilo_traj(uid: str, turns: list[tuple[int, int, float, str | None]], obs: list[list[int]], reward: float
              ) -> Trajectory:  # fmt: skip
    """A trajectory of `turns` (model tokens, token id, score, state key) separated by observations `obs`."""
    ids, mask, spans = [], [], []
    for k, (n, tok, score, key) in enumerate(turns):
        start = len(ids)
        ids += [tok] * n
        mask += [1] * n
        gen_end = len(ids)
        if k < len(obs):
            ids += obs[k]
            mask += [0] * len(obs[k])
        spans.append(Turn(gen_start=start, gen_end=gen_end, obs_end=len(ids), score=score, state_key=key))
    return Trajectory(uid=uid, prompt_ids=[1, 2], response_ids=ids, loss_mask=mask, rollout_logprobs=[0.0] * len(ids),
                      reward=reward, turns=spans, outcome="ok" if reward >= 1 else "policy_failure")


def test_step_groups_form_exactly_when_observations_match():
    """Anchor keys: the prompt for the first turn, then the observation ids before the turn (or a state key)."""
    same, other = [7, 8, 9], [7, 8, 10]
    a = from_trajectory(hilo_traj("p", [(2, 5, 0.0, None), (2, 6, 1.0, None)], [same], 1.0))
    b = from_trajectory(hilo_traj("p", [(1, 5, 0.0, None), (3, 6, 0.0, None)], [same], 0.0))
    c = from_trajectory(hilo_traj("p", [(2, 5, 0.0, None), (2, 6, 0.0, None)], [other], 0.0))
    assert a.turn_keys[0] == b.turn_keys[0] == c.turn_keys[0]  # all start from the prompt
    assert a.turn_keys[1] == b.turn_keys[1] != c.turn_keys[1]
    # an interaction's state key wins over the observation ids
    d = from_trajectory(hilo_traj("p", [(2, 5, 0.0, None), (2, 6, 0.0, "9-15-3")], [other], 0.0))
    e = from_trajectory(hilo_traj("p", [(2, 5, 0.0, None), (2, 6, 0.0, "9-15-3")], [same], 0.0))
    assert d.turn_keys[1] == e.turn_keys[1] != a.turn_keys[1]
    # through the estimator: with step_weight 1 and gamma 1, a's second turn is compared with b's only
    seqs = [a, b, c]
    algo = AlgorithmConfig(adv_estimator="gigpo", gigpo={"step_weight": 1.0})
    assign_advantages(seqs, algo, 0.0)
    episode = [s.advantages[0].item() / 2 for s in seqs]  # turn 0: one step group = the episode's group
    step_a = a.advantages[2 + 3].item() - episode[0]  # a's second turn starts after 2 model + 3 obs tokens
    step_c = c.advantages[2 + 3].item() - episode[2]
    assert step_a == pytest.approx(math.sqrt(0.5), abs=1e-5) and step_c == pytest.approx(0.0, abs=1e-6)


def test_turn_scores_become_token_rewards_and_the_rest_goes_last():
    t = hilo_traj("p", [(2, 5, 0.25, None), (2, 6, 0.5, None)], [[7, 8]], 2.0)
    s = from_trajectory(t)
    mask = pad_field([s.loss_mask])
    assert turn_token_rewards([s], mask).tolist() == [[0.0, 0.25, 0.0, 0.0, 0.0, 1.75]]
    assert turn_index([s], 7).tolist() == [[0, 0, 0, 0, 1, 1, -1]]


def shard_reducer(i: int, barrier: threading.Barrier, slots: list):
    def reduce(t, op="sum"):
        slots[i] = t.clone()
        barrier.wait()
        out = slots[0] + slots[1] if op == "sum" else torch.maximum(slots[0], slots[1])
        barrier.wait()
        return out
    return reduce


@pytest.mark.parametrize("estimator", ["grpo_turn", "gigpo", "gae"])
def test_sharded_turn_advantages_equal_the_whole_batch(estimator):
    """Groups whole on a worker; gae's whitening over an all-reduce; an empty worker still joins in."""
    def trajs():
        obs = [[7, 8]]
        return [hilo_traj("a", [(2, 5, 0.1, None), (1, 6, 1.0, None)], obs, 1.1),
                hilo_traj("a", [(1, 5, 0.0, None), (3, 6, 0.0, None)], obs, 0.0),
                hilo_traj("b", [(3, 5, 0.2, None), (2, 6, 0.3, None)], [[9]], 0.5),
                hilo_traj("b", [(2, 5, 1.0, None)], [], 1.0)]

    algo = AlgorithmConfig(adv_estimator=estimator, gamma=0.9, lam=0.95,
                           **({"gae_timestep_unit": "turn"} if estimator == "gae" else {}))
    for split in (2, 4):  # two groups on two workers; everything on one worker and nothing on the other
        whole = [from_trajectory(t) for t in trajs()]
        left, right = [from_trajectory(t) for t in trajs()[:split]], [from_trajectory(t) for t in trajs()[split:]]
        for s in whole + left + right:
            s.old_values = torch.linspace(0.1, 0.5, s.response_len)
        assign_advantages(whole, algo, 0.0)
        barrier, slots = threading.Barrier(2), [None, None]
        workers = [threading.Thread(target=assign_advantages, args=(shard, algo, 0.0, shard_reducer(i, barrier, slots)))
                   for i, shard in enumerate((left, right))]
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=30)
        for got, want in zip(left + right, whole):
            assert_close(got.advantages, want.advantages, rtol=1e-5, atol=1e-6)
            assert_close(got.returns, want.returns, rtol=1e-5, atol=1e-6)


def test_config_keys_are_validated():
    cfg = load_config(None, ["algorithm.adv_estimator=gae", "algorithm.gae_timestep_unit=turn"])
    assert cfg.algorithm.gae_timestep_unit == "turn"
    with pytest.raises(ConfigError, match="gae_timestep_unit"):
        load_config(None, ["algorithm.adv_estimator=grpo", "algorithm.gae_timestep_unit=turn"])
    with pytest.raises(ConfigError, match="algorithm.gigpo"):
        load_config(None, ["algorithm.gigpo.step_weight=0.5"])
    with pytest.raises(ConfigError, match="step_weight"):
        load_config(None, ["algorithm.adv_estimator=gigpo", "algorithm.gigpo.step_weight=-1"])
    with pytest.raises(ConfigError, match="gae_timestep_unit"):
        load_config(None, ["algorithm.adv_estimator=gae", "algorithm.gae_timestep_unit=step"])
