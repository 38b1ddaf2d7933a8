"""What every advantage estimator shares: its inputs, the registry it joins, and group/batch statistics.

Estimators live in ``advantages.py`` (outcome and token estimators) and ``turn_advantages.py``
(turn estimators); both register with ``register_adv_estimator`` into ``verl_agent.registry.ADV_ESTIMATORS``
(the names ``algorithm.adv_estimator`` accepts), and ``advantages.compute_advantages`` looks them up there.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch
from torch import Tensor

from verl_agent.registry import ADV_ESTIMATORS
from verl_agent.trainer.algorithms.losses import masked_mean, masked_sum

__all__ = ["ADV_ESTIMATORS", "AdvantageFn", "AdvantageInputs", "AllReduce", "group_normalize", "group_stats",
           "masked_whiten", "need_groups", "needs_critic", "needs_groups", "register_adv_estimator"]

AllReduce = Callable[..., Tensor]  # (tensor, op="sum"|"max") -> the tensor combined over the workers of a batch


@dataclass(frozen=True)
class AdvantageInputs:
    """Everything an estimator may read; ``compute_advantages`` fills it."""

    token_rewards: Tensor  # [B, T] reward per position (outcome on the last model token)
    scores: Tensor  # [B] trajectory reward (sum of token_rewards unless given)
    response_mask: Tensor  # [B, T] 1 on model tokens
    group_ids: Tensor | None  # [B] dense ids 0..G-1, same id = same prompt
    values: Tensor | None  # [B, T] critic values (gae only)
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    epsilon: float = 1e-6
    all_reduce: AllReduce | None = None  # batch-wide statistics over workers (whitening); None: this batch only
    turn_index: Tensor | None = None  # [B, T] long: the assistant turn of each position (-1: padding); None: one turn
    turn_keys: list[list[Hashable]] | None = None  # per row, the anchor state of each turn (gigpo)
    step_weight: float = 1.0  # gigpo: weight of the step-level advantage
    timestep_unit: str = "token"  # gae: "token" or "turn"
    episode_norm: str = "trajectory"  # gigpo: episode statistics over trajectories or over step (turn) rows
    singleton_group: str = "verl"  # gigpo: episode advantage of a group of one trajectory ("verl" or "zero")


AdvantageFn = Callable[[AdvantageInputs], "tuple[Tensor, Tensor]"]


def register_adv_estimator(name: str, *, groups: bool = False, critic: bool = False
                           ) -> Callable[[AdvantageFn], AdvantageFn]:  # fmt: skip
    """Register ``fn(inputs) -> (advantages [B,T], returns [B,T])`` as ``algorithm.adv_estimator=name``.

    groups: it compares the trajectories of one prompt (a group cut to one trajectory by failures is dropped);
    critic: it reads ``inputs.values`` (the trainer builds and trains a critic).
    """
    return ADV_ESTIMATORS.register(name, groups=groups, critic=critic)


def needs_groups(name: str) -> bool:
    """Whether the estimator registered as `name` compares the trajectories of a group."""
    return bool(ADV_ESTIMATORS.meta(name).get("groups", False))


def needs_critic(name: str) -> bool:
    """Whether the estimator registered as `name` reads a critic's values."""
    return bool(ADV_ESTIMATORS.meta(name).get("critic", False))


def group_stats(scores: Tensor, gids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-group (count, sum, unbiased std), indexed by group id."""
    gids = gids.to(scores.device)
    G = int(gids.max()) + 1 if gids.numel() else 0
    zeros = torch.zeros(G, device=scores.device, dtype=scores.dtype)
    count = zeros.clone().index_add_(0, gids, torch.ones_like(scores))
    total = zeros.clone().index_add_(0, gids, scores)
    sq = (scores - (total / count)[gids]).square()
    var = zeros.clone().index_add_(0, gids, sq) / (count - 1).clamp(min=1)
    return count, total, var.sqrt()


def need_groups(inp: AdvantageInputs, name: str) -> Tensor:
    """The group ids of a group estimator's input, or a clear error naming the estimator."""
    if inp.group_ids is None:
        raise ValueError(f"adv_estimator {name!r} needs group_index (one uid per prompt)")
    return inp.group_ids.to(inp.scores.device)


def group_normalize(x: Tensor, gids: Tensor, by_std: bool, epsilon: float, singleton: str = "verl") -> Tensor:
    """(x - mean_group) / (std_group + eps) per entry (no std when ``by_std`` is False).

    Groups of one: ``singleton="verl"`` keeps verl's rule (mean 0, std 1: the entry itself),
    ``"zero"`` gives 0 (nothing to compare with).

    The statistics are taken in float64: a group of equal values then has mean exactly that value, so
    its advantages are exactly 0. In float32 the mean of, say, sixteen 0.7s is off by about 1e-8, and
    dividing by std + eps (1e-6) turns that into advantages of about +-0.1.
    """
    x64 = x.double()
    count, total, std = group_stats(x64, gids)
    single = count[gids] == 1
    adv = x64 - torch.where(single, 0.0, (total / count)[gids])
    if by_std:
        adv = adv / (torch.where(single, 1.0, std[gids]) + epsilon)
    return (torch.where(single, 0.0, adv) if singleton == "zero" else adv).to(x.dtype)


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-8, all_reduce: AllReduce | None = None) -> Tensor:
    """(x - mean) / sqrt(var + eps) over masked-in entries (unbiased var, as verl); 0 off the mask.

    With ``all_reduce`` the mean and variance are those of all workers' entries together.
    """
    if all_reduce is None:
        mean = masked_mean(x, mask)
        n = mask.sum()
        var = masked_sum((x - mean).square(), mask) / (n - 1).clamp(min=1)
    else:
        total = all_reduce(torch.stack([masked_sum(x, mask), mask.sum()]).double())
        mean, n = (total[0] / total[1].clamp(min=1)).to(x.dtype), total[1]
        var = (all_reduce(masked_sum((x - mean).square(), mask).double().reshape(1))[0] / (n - 1).clamp(min=1))
        var = var.to(x.dtype)
    return torch.where(mask.bool(), (x - mean) * torch.rsqrt(var + eps), 0.0)
