"""Advantage estimators, registered by name (``algorithm.adv_estimator``, verl's names).

Outcome estimators (``grpo``, ``rloo``, ``reinforce_plus_plus_baseline``) turn one
score per trajectory into one advantage per trajectory and broadcast it over
the model's tokens. Token estimators (``gae``, ``reinforce_plus_plus``) run a
discounted recursion over token-level rewards.

Time axis of the token estimators: only the model's tokens (mask 1) are time
steps. A tool response or user turn in the middle of a trajectory (mask 0) is
part of the environment's transition, not an action, so discounting and
bootstrapping jump straight from the last model token before it to the first
model token after it; values predicted at mask-0 positions are ignored. A
reward placed on a mask-0 position (e.g. a tool's reward) is credited to the
closest model token before it, the action that caused it; a non-zero reward
before the first model token is an error. (Restarting the return at every mask-0
token would cut multi-turn credit assignment.)

Singleton groups follow verl: mean 0 and std 1, so the advantage is the score.

Turn estimators (``grpo_turn``, ``gigpo``, ``gae`` with ``timestep_unit="turn"``) live in
``turn_advantages.py``; importing this module registers them too (all share
``verl_agent.registry.ADV_ESTIMATORS``); they read ``turn_index`` (which assistant
turn each position belongs to) and, for GiGPO, ``turn_keys`` (the anchor state of each turn).

Sharded batches: group estimators need only their group, which the trainer keeps
on one worker. Batch-wide whitening (``reinforce_plus_plus*``, ``gae``) takes an
``all_reduce`` (sum over workers); with it, each worker's slice equals the slice
of the whole batch whitened at once.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch
from torch import Tensor

from verl_agent.trainer.algorithms.advantage_base import (
    ADV_ESTIMATORS, AdvantageFn, AdvantageInputs, AllReduce, group_normalize, group_stats, masked_whiten, need_groups,
    register_adv_estimator,
)
from verl_agent.trainer.algorithms.turn_advantages import gae_turn

__all__ = [
    "AdvantageInputs", "ADV_ESTIMATORS", "register_adv_estimator", "get_adv_estimator",
    "compute_advantages", "group_ids_from_index", "masked_whiten", "scores_to_token_rewards",
    "apply_kl_in_reward", "filter_uniform_groups", "group_normalize", "AllReduce", "KLController", "make_kl_controller",
]


def get_adv_estimator(name: str) -> AdvantageFn:
    """The estimator registered as `name`; an unknown name raises `RegistryError` (a ValueError) listing them."""
    return ADV_ESTIMATORS.get(name)


def compute_advantages(
    name: str, *, response_mask: Tensor, token_rewards: Tensor | None = None, scores: Tensor | None = None,
    group_index: Tensor | Sequence[Hashable] | None = None, values: Tensor | None = None,
    gamma: float = 1.0, lam: float = 1.0, norm_adv_by_std_in_grpo: bool = True, epsilon: float = 1e-6,
    all_reduce: AllReduce | None = None, turn_index: Tensor | None = None,
    turn_keys: list[list[Hashable]] | None = None, step_weight: float = 1.0, timestep_unit: str = "token",
    episode_norm: str = "trajectory", singleton_group: str = "verl",
) -> tuple[Tensor, Tensor]:
    """Run estimator ``name``; give ``token_rewards`` [B,T] or ``scores`` [B] (or both).

    Missing ``scores`` = row sums of ``token_rewards``; missing ``token_rewards`` =
    each score on the row's last model token. Both outputs are zero off the mask.
    Turn estimators: ``turn_index`` [B,T] numbers each position's assistant turn (0, 1, ...;
    -1 on padding; a turn's span runs from its first model token to the next turn's), the
    reward of a turn is the sum of the token rewards in its span; ``turn_keys[i][k]`` is the
    anchor state of row i's turn k (gigpo). Without ``turn_index`` every row is one turn.
    ``episode_norm`` and ``singleton_group``: gigpo's episode-level options (``turn_advantages.gigpo_advantage``).
    """
    fn = get_adv_estimator(name)
    if response_mask.dim() != 2:
        raise ValueError(f"response_mask must be [B, T], got shape {tuple(response_mask.shape)}")
    B = response_mask.shape[0]
    if token_rewards is None and scores is None:
        raise ValueError(f"adv_estimator {name!r}: pass token_rewards [B, T] or scores [B]")
    if token_rewards is not None and token_rewards.shape != response_mask.shape:
        raise ValueError(f"token_rewards has shape {tuple(token_rewards.shape)}, "
                         f"response_mask {tuple(response_mask.shape)}")
    if scores is not None and scores.shape != (B,):
        raise ValueError(f"scores must have shape ({B},), got {tuple(scores.shape)}")
    if values is not None and values.shape != response_mask.shape:
        raise ValueError(f"values has shape {tuple(values.shape)}, response_mask {tuple(response_mask.shape)}")
    if turn_index is not None and turn_index.shape != response_mask.shape:
        raise ValueError(f"turn_index has shape {tuple(turn_index.shape)}, response_mask {tuple(response_mask.shape)}")
    if timestep_unit not in ("token", "turn"):
        raise ValueError(f"algorithm.gae_timestep_unit must be token or turn, got {timestep_unit!r}")
    if episode_norm not in ("trajectory", "step"):
        raise ValueError(f"algorithm.gigpo.episode_norm must be trajectory or step, got {episode_norm!r}")
    if singleton_group not in ("verl", "zero"):
        raise ValueError(f"algorithm.gigpo.singleton_group must be verl or zero, got {singleton_group!r}")
    if scores is None:
        scores = token_rewards.sum(-1)
    if token_rewards is None:
        token_rewards = scores_to_token_rewards(scores, response_mask)
    gids = None if group_index is None else group_ids_from_index(group_index, B)
    inputs = AdvantageInputs(token_rewards.float(), scores.float(), response_mask, gids, values,
                             gamma, lam, norm_adv_by_std_in_grpo, epsilon, all_reduce, turn_index, turn_keys,
                             step_weight, timestep_unit, episode_norm, singleton_group)
    return fn(inputs)


def group_ids_from_index(group_index: Tensor | Sequence[Hashable], batch_size: int) -> Tensor:
    """Dense group ids 0..G-1 from a LongTensor [B] or a list of uids (e.g. prompt uid strings)."""
    if isinstance(group_index, Tensor) and group_index.dim() != 1:
        raise ValueError(f"group_index must be a 1-d tensor [B], got shape {tuple(group_index.shape)}")
    if len(group_index) != batch_size:
        raise ValueError(f"group_index has {len(group_index)} entries for a batch of {batch_size}")
    if isinstance(group_index, Tensor):
        return torch.unique(group_index, return_inverse=True)[1]
    dense: dict[Hashable, int] = {}
    return torch.tensor([dense.setdefault(u, len(dense)) for u in group_index], dtype=torch.long)


def _broadcast(per_seq: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask.bool(), per_seq.unsqueeze(-1), torch.zeros((), device=per_seq.device))


@register_adv_estimator("grpo", groups=True)
def grpo_advantage(inp: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """(s - mean_group) / (std_group + eps); Dr. GRPO (no std) when norm_adv_by_std_in_grpo=False."""
    gids = need_groups(inp, "grpo")
    adv = group_normalize(inp.scores, gids, inp.norm_adv_by_std_in_grpo, inp.epsilon)
    adv = _broadcast(adv, inp.response_mask)
    return adv, adv


@register_adv_estimator("rloo", groups=True)
def rloo_advantage(inp: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """s_i - mean of the other members of its group: (n s_i - sum) / (n - 1)."""
    gids = need_groups(inp, "rloo")
    count, total, _ = group_stats(inp.scores, gids)
    n, tot = count[gids], total[gids]
    adv = torch.where(n > 1, (n * inp.scores - tot) / (n - 1).clamp(min=1), inp.scores)
    adv = _broadcast(adv, inp.response_mask)
    return adv, adv


@register_adv_estimator("reinforce_plus_plus_baseline", groups=True)
def reinforce_pp_baseline_advantage(inp: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """s - group mean, broadcast, then whitened over all model tokens of the batch."""
    gids = need_groups(inp, "reinforce_plus_plus_baseline")
    count, total, _ = group_stats(inp.scores, gids)
    adv = inp.scores - torch.where(count[gids] == 1, 0.0, (total / count)[gids])
    adv = masked_whiten(_broadcast(adv, inp.response_mask), inp.response_mask, all_reduce=inp.all_reduce)
    return adv, adv


@register_adv_estimator("reinforce_plus_plus")
def reinforce_pp_advantage(inp: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """Discounted return-to-go over model tokens, whitened over the batch (no critic)."""
    mask = inp.response_mask
    rewards = _pack_rewards(inp.token_rewards, mask)
    returns = torch.zeros_like(rewards)
    running = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + inp.gamma * running
        returns[:, t] = running
    returns = _unpack(returns, mask)
    return masked_whiten(returns, mask, all_reduce=inp.all_reduce), returns


@register_adv_estimator("gae", critic=True)
def gae_advantage(inp: AdvantageInputs) -> tuple[Tensor, Tensor]:
    """GAE(gamma, lam) with a critic; returns = adv + V (critic target); adv whitened.

    With ``timestep_unit="turn"`` the time steps are assistant turns (turn_advantages.gae_turn).
    """
    if inp.values is None:
        raise ValueError("adv_estimator 'gae' needs values [B, T] from the critic")
    if inp.timestep_unit == "turn":
        return gae_turn(inp)
    mask = inp.response_mask
    rewards = _pack_rewards(inp.token_rewards, mask)
    values = _pack(inp.values.float(), mask)
    adv = torch.zeros_like(rewards)
    last = next_value = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):  # padding after a row's end has r = V = 0: terminal
        delta = rewards[:, t] + inp.gamma * next_value - values[:, t]
        last = delta + inp.gamma * inp.lam * last
        adv[:, t] = last
        next_value = values[:, t]
    returns = _unpack(adv + values, mask)
    return masked_whiten(_unpack(adv, mask), mask, all_reduce=inp.all_reduce), returns


def _pack_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """Pack rewards onto the model-token axis; a reward at a mask-0 position goes to the model token before it."""
    step = mask.long().cumsum(-1) - 1  # index of the latest model token, -1 before the first
    orphan = (step < 0) & (rewards != 0)
    if bool(orphan.any()):
        row = int(orphan.nonzero()[0, 0])
        raise ValueError(f"token_rewards row {row} has a non-zero reward before its first model token")
    L = int(mask.sum(-1).max()) if mask.numel() else 0
    packed = torch.zeros(mask.shape[0], L, dtype=rewards.dtype, device=rewards.device)
    if L:
        packed.scatter_add_(1, step.clamp(min=0), torch.where(step >= 0, rewards, 0.0))
    return packed


def _model_positions(mask: Tensor) -> Tensor:
    """[B, T]: column k holds the position of the row's k-th model token (junk past the count)."""
    T = mask.shape[1]
    key = torch.where(mask.bool(), 0, T) + torch.arange(T, device=mask.device)  # model tokens sort first
    return key.argsort(dim=1) % T if T else key


def _pack(x: Tensor, mask: Tensor) -> Tensor:
    """[B, T] -> [B, L]: the values at model tokens, left-aligned, zero after each row's count."""
    L = int(mask.sum(-1).max()) if mask.numel() else 0
    packed = torch.gather(x, 1, _model_positions(mask)[:, :L])
    return torch.where(torch.arange(L, device=x.device) < mask.sum(-1, keepdim=True), packed, 0.0)


def _unpack(packed: Tensor, mask: Tensor) -> Tensor:
    """Inverse of ``_pack``: zeros at mask-0 positions."""
    step = (mask.long().cumsum(-1) - 1).clamp(min=0, max=max(packed.shape[1] - 1, 0))
    if packed.shape[1] == 0:
        return torch.zeros(mask.shape, dtype=packed.dtype, device=packed.device)
    return torch.where(mask.bool(), torch.gather(packed, 1, step), 0.0)


def scores_to_token_rewards(scores: Tensor, mask: Tensor) -> Tensor:
    """[B] outcome scores -> [B, T] with each score on its row's last model token."""
    T = mask.shape[1]
    last = T - 1 - mask.flip(-1).long().argmax(-1)
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    has = mask.bool().any(-1)
    out[has, last[has]] = scores.float()[has]
    return out


def apply_kl_in_reward(token_rewards: Tensor, kl: Tensor, kl_coef: float, mask: Tensor) -> Tensor:
    """``algorithm.use_kl_in_reward``: r_t - kl_coef * KL_t on model tokens (kl from ``kl_penalty``)."""
    if kl.shape != mask.shape or token_rewards.shape != mask.shape:
        raise ValueError(f"token_rewards {tuple(token_rewards.shape)}, kl {tuple(kl.shape)} and mask "
                         f"{tuple(mask.shape)} must have the same shape")
    return token_rewards - kl_coef * torch.where(mask.bool(), kl, 0.0)


def filter_uniform_groups(scores: Tensor, group_index: Tensor | Sequence[Hashable], atol: float = 0.0) -> Tensor:
    """Keep mask [B] that drops groups whose scores are all equal (DAPO dynamic sampling).

    Such a group has zero advantage under GRPO, so it only dilutes the batch.
    Groups of one are kept (nothing to compare), as in verl.
    """
    gids = group_ids_from_index(group_index, scores.shape[0]).to(scores.device)
    G = int(gids.max()) + 1 if gids.numel() else 0
    s = scores.float()
    hi = torch.full((G,), -torch.inf, device=s.device).scatter_reduce(0, gids, s, "amax")
    lo = torch.full((G,), torch.inf, device=s.device).scatter_reduce(0, gids, s, "amin")
    count = torch.zeros(G, device=s.device).index_add_(0, gids, torch.ones_like(s))
    return ((hi - lo) > atol)[gids] | (count[gids] == 1)


class KLController:
    """The in-reward KL coefficient (``algorithm.kl_ctrl``): fixed, or verl's adaptive controller.

    Adaptive (Ziegler et al. 2019): after each step, with the batch's mean KL per sequence,
    ``coef *= 1 + clip(kl / target_kl - 1, -0.2, 0.2) * n_sequences / horizon``.
    """

    def __init__(self, kind: str, kl_coef: float, target_kl: float = 0.1, horizon: int = 10000) -> None:
        if kind not in ("fixed", "adaptive"):
            raise ValueError(f"algorithm.kl_ctrl.type must be fixed or adaptive, got {kind!r}")
        self.kind, self.value, self.target, self.horizon = kind, float(kl_coef), float(target_kl), int(horizon)

    def update(self, current_kl: float, n_sequences: int) -> None:
        if self.kind == "adaptive":
            error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
            self.value *= 1.0 + error * n_sequences / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


def make_kl_controller(kl_ctrl) -> KLController:
    """From ``algorithm.kl_ctrl`` (KLCtrlConfig)."""
    return KLController(kl_ctrl.type, kl_ctrl.kl_coef, kl_ctrl.target_kl, kl_ctrl.horizon)
