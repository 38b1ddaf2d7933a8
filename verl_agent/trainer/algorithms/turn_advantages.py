"""Turn-level advantage estimators: credit per assistant turn instead of one number per trajectory.

A multi-turn trajectory is a sequence of turns k = 0..K-1. ``turn_index`` [B, T] says which
turn each position belongs to (a turn's span runs from its first model token up to the next
turn's first model token, so the observation after a turn belongs to it); the reward of turn k,
r_k, is the sum of the token rewards in its span (the trainer puts each turn's score on its last
model token and the rest of the trajectory's reward on the last turn, so sum_k r_k = the reward).
The discounted return of turn k is G_k = r_k + gamma * G_{k+1} (``algorithm.gamma`` per turn).
Every model token of turn k gets turn k's advantage.

- ``grpo_turn``: G_k normalised within the prompt's group at each turn index k (the members
  that reached turn k), as GRPO normalises scores; groups of one follow GRPO's (verl's) rule.
  With one turn per trajectory and any gamma this is exactly ``grpo``.
- ``gigpo`` (Feng et al. 2025, "Group-in-Group Policy Optimization"): the episode-level GRPO
  advantage of the trajectory plus ``step_weight`` times a step-level advantage: turns of the
  group's trajectories that start from the same anchor state (``turn_keys``: identical
  observation ids, or a key the interaction gives) form a step group, and G_k is normalised
  within it. A turn whose state no other turn of the group shares has step advantage 0.
  The episode part has two forms (``episode_norm``): ``trajectory`` (the paper's: mean and std over
  the group's trajectories) and ``step`` (the authors' code's default: over the group's step rows,
  one per turn, each carrying its trajectory's reward, so longer trajectories weigh more). A group of
  one entry follows verl's rule (mean 0, std 1: its reward); ``singleton_group="zero"`` gives a group
  of one trajectory episode advantage 0 instead.
- ``gae`` with ``timestep_unit="turn"``: the critic's value of turn k is the value at its first
  model token (the state it starts from); GAE runs over turns, with V = 0 after the last one:
  delta_k = r_k + gamma V_{k+1} - V_k, A_k = delta_k + gamma lam A_{k+1}; returns (the critic's
  targets) are A_k + V_k on the turn's tokens; advantages whitened over the batch as ``gae``.

The group estimators need only the group, which the trainer keeps on one worker; ``gae`` takes
the batch-wide ``all_reduce`` for whitening.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch
from torch import Tensor

from verl_agent.trainer.algorithms.advantage_base import (
    AdvantageInputs, group_normalize, masked_whiten, need_groups, register_adv_estimator,
)

__all__ = ["turn_rewards", "turn_returns", "step_group_ids", "gigpo_episode_advantage", "grpo_turn_advantage",
           "gigpo_advantage", "gae_turn"]


def _turn_index(inp: AdvantageInputs) -> Tensor:
    """[B, T] turn of each position; without turn_index every model token is turn 0."""
    mask = inp.response_mask
    if inp.turn_index is None:
        return torch.zeros(mask.shape, dtype=torch.long, device=mask.device)
    return inp.turn_index.to(mask.device).long()


def turn_rewards(token_rewards: Tensor, turn_index: Tensor) -> tuple[Tensor, Tensor]:
    """([B, K] reward of each turn = sum of its span's token rewards, [B, K] bool: the turn exists)."""
    B = token_rewards.shape[0]
    K = int(turn_index.max()) + 1 if turn_index.numel() else 0
    K = max(K, 1)
    inside = turn_index >= 0
    rewards = torch.zeros(B, K, dtype=token_rewards.dtype, device=token_rewards.device)
    rewards.scatter_add_(1, turn_index.clamp(min=0), torch.where(inside, token_rewards, 0.0))
    n_turns = torch.where(inside, turn_index + 1, 0).amax(-1) if turn_index.shape[1] else turn_index.new_zeros(B)
    exists = torch.arange(K, device=turn_index.device) < n_turns.unsqueeze(-1)
    return rewards, exists


def turn_returns(rewards: Tensor, gamma: float) -> Tensor:
    """[B, K] discounted return per turn: G_k = r_k + gamma G_{k+1} (turns past a row's end have r = 0)."""
    returns = torch.zeros_like(rewards)
    running = rewards.new_zeros(rewards.shape[0])
    for k in reversed(range(rewards.shape[1])):
        running = rewards[:, k] + gamma * running
        returns[:, k] = running
    return returns


def _to_tokens(per_turn: Tensor, turn_index: Tensor, mask: Tensor) -> Tensor:
    """[B, K] -> [B, T]: each model token gets its turn's value; 0 off the mask."""
    vals = torch.gather(per_turn, 1, turn_index.clamp(min=0))
    return torch.where(mask.bool() & (turn_index >= 0), vals, 0.0)


def _dense(keys: list[Hashable]) -> Tensor:
    ids: dict[Hashable, int] = {}
    return torch.tensor([ids.setdefault(k, len(ids)) for k in keys], dtype=torch.long)


@register_adv_estimator("grpo_turn", groups=True)
def grpo_turn_advantage(inp: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """Per-turn discounted returns, normalised within (prompt group, turn index)."""
    gids = need_groups(inp, "grpo_turn")
    tidx = _turn_index(inp)
    rewards, exists = turn_rewards(inp.token_rewards, tidx)
    returns = turn_returns(rewards, inp.gamma)
    rows, ks = exists.nonzero(as_tuple=True)
    adv = torch.zeros_like(returns)
    if rows.numel():
        cells = _dense(list(zip(gids[rows].tolist(), ks.tolist()))).to(returns.device)
        adv[rows, ks] = group_normalize(returns[rows, ks], cells, inp.norm_adv_by_std_in_grpo, inp.epsilon)
    adv = _to_tokens(adv, tidx, inp.response_mask)
    return adv, adv


def step_group_ids(gids: Tensor, turn_keys: list[list[Hashable]], exists: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(rows, turns, step group id) of every existing turn; turns share a step group exactly when they are
    in the same prompt group and their anchor keys are equal."""
    rows, ks = exists.nonzero(as_tuple=True)
    keys = []
    for i, k in zip(rows.tolist(), ks.tolist()):
        if k >= len(turn_keys[i]):
            raise ValueError(f"gigpo: row {i} has {len(turn_keys[i])} turn keys but at least {k + 1} turns")
        keys.append((int(gids[i]), turn_keys[i][k]))
    return rows, ks, _dense(keys)


def gigpo_episode_advantage(inp: AdvantageInputs, gids: Tensor, n_turns: Tensor) -> Tensor:
    """[B] GiGPO's episode-level advantage of each trajectory (see the module docstring).

    ``step``: every trajectory stands in its group's statistics once per turn (``n_turns``, at least 1),
    as the reference code's rows do; all rows of a trajectory share its reward, so they share one value.
    """
    by_std, eps = inp.norm_adv_by_std_in_grpo, inp.epsilon
    if inp.episode_norm == "step":
        reps = n_turns.clamp(min=1).to(gids.device)
        rows = torch.repeat_interleave(torch.arange(len(reps), device=gids.device), reps)
        per_row = group_normalize(inp.scores[rows], gids[rows], by_std, eps)
        adv = per_row[torch.cumsum(reps, 0) - reps]  # each trajectory's first row
    else:
        adv = group_normalize(inp.scores, gids, by_std, eps)
    if inp.singleton_group == "zero":
        alone = torch.bincount(gids)[gids] == 1
        adv = torch.where(alone, 0.0, adv)
    return adv


@register_adv_estimator("gigpo", groups=True)
def gigpo_advantage(inp: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """Episode-level GRPO advantage + step_weight * step-level advantage over anchor-state groups."""
    gids = need_groups(inp, "gigpo")
    if inp.turn_keys is None or len(inp.turn_keys) != inp.scores.shape[0]:
        raise ValueError("adv_estimator 'gigpo' needs turn_keys: one list of anchor-state keys per row")
    tidx = _turn_index(inp)
    rewards, exists = turn_rewards(inp.token_rewards, tidx)
    returns = turn_returns(rewards, inp.gamma)
    episode = gigpo_episode_advantage(inp, gids, exists.sum(-1))
    rows, ks, cells = step_group_ids(gids, inp.turn_keys, exists)
    step = torch.zeros_like(returns)
    if rows.numel():
        step[rows, ks] = group_normalize(returns[rows, ks], cells.to(returns.device), inp.norm_adv_by_std_in_grpo,
                                         inp.epsilon, singleton="zero")
    adv = _to_tokens(episode.unsqueeze(-1) + inp.step_weight * step, tidx, inp.response_mask)
    return adv, adv


def gae_turn(inp: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """GAE over turns (the ``gae`` estimator with timestep_unit="turn"); see the module docstring."""
    mask = inp.response_mask
    tidx = _turn_index(inp)
    rewards, exists = turn_rewards(inp.token_rewards, tidx)
    B, K = rewards.shape
    # V_k: the critic's value at turn k's first position (its first model token)
    first = torch.full((B, K), mask.shape[1], dtype=torch.long, device=mask.device)
    pos = torch.arange(mask.shape[1], device=mask.device).expand_as(tidx)
    if mask.shape[1]:
        first.scatter_reduce_(1, tidx.clamp(min=0), torch.where(tidx >= 0, pos, mask.shape[1]), "amin")
    values = inp.values.float().to(mask.device)
    v = torch.where(exists, torch.gather(values, 1, first.clamp(max=max(mask.shape[1] - 1, 0))) if mask.shape[1]
                    else rewards, 0.0)
    adv = torch.zeros_like(rewards)
    last = next_value = rewards.new_zeros(B)
    for k in reversed(range(K)):  # turns past a row's end have r = V = 0: terminal
        delta = rewards[:, k] + inp.gamma * next_value - v[:, k]
        last = delta + inp.gamma * inp.lam * last
        adv[:, k] = last
        next_value = v[:, k]
    returns = _to_tokens(adv + v, tidx, mask)
    return masked_whiten(_to_tokens(adv, tidx, mask), mask, all_reduce=inp.all_reduce), returns
