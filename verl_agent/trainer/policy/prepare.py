"""From a worker's trajectories to training sequences with advantages (runs on the worker that rolled them out).

    seqs, counts = train_seqs(trajectories, group_estimator=True)      # failure rules applied
    ... old / ref log-probs and values are attached by the worker ...
    metrics, kl = assign_advantages(seqs, algorithm, kl_coef, all_reduce)
    seqs, kept = filter_groups(seqs, algorithm.filter_groups.metric, all_reduce)

Rewards: each turn's score (interaction, tools, or a reward function's per-turn list) sits on
the turn's last model token and the rest of the trajectory's reward on its last model token, so
a row's token rewards sum to its reward and the turn estimators see where it was earned.

Failure rules: infrastructure failures and filtered prompts never reach the loss, and
a group (same uid) that lost members to them and keeps fewer than 2 is dropped, since
a group estimator cannot compare one sample with nothing. GRPO groups are whole on one
worker, so group statistics are local; batch-wide statistics (whitening, metrics)
come from `all_reduce`, which sums over the workers.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch import Tensor

from verl_agent.protocol import SUCCESS_THRESHOLD, Trajectory
from verl_agent.trainer.algorithms.advantage_base import needs_critic
from verl_agent.trainer.algorithms import (
    AllReduce, apply_kl_in_reward, compute_advantages, filter_uniform_groups, kl_penalty, scores_to_token_rewards,
)
from verl_agent.trainer.policy.batch import TrainSeq, from_trajectory, pad_field

__all__ = ["train_seqs", "assign_advantages", "filter_groups", "log_prob_metrics",
           "apply_rollout_correction", "rollout_is_weights", "add_rollout_is_stats", "rollout_is_metrics",
           "turn_token_rewards", "turn_index"]

def _local(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """The all-reduce of a single worker: nothing to combine."""
    return t


def train_seqs(trajs: list[Trajectory], group_estimator: bool) -> tuple[list[TrainSeq], dict[str, float]]:
    """Trainable trajectories as TrainSeqs, and counts of what was left out and why."""
    usable = [t for t in trajs if t.trainable]
    size, left = Counter(t.uid for t in trajs), Counter(t.uid for t in usable)
    dropped = {uid for uid in left if group_estimator and left[uid] < size[uid] and left[uid] < 2}
    seqs = []
    for i, t in enumerate(trajs):
        if t.trainable and t.uid not in dropped:
            seqs.append(from_trajectory(t))
            seqs[-1].extra["trajectory"] = i  # its position in `trajs` (the step's records carry its advantages)
    counts = {"train/excluded_trajectories": float(len(trajs) - len(usable)),
              "train/dropped_groups": float(len(dropped)), "train/sequences": float(len(seqs))}
    return seqs, counts


def assign_advantages(seqs: list[TrainSeq], algo, kl_coef: float, all_reduce: AllReduce = _local
                      ) -> tuple[dict[str, float], float]:  # fmt: skip
    """Run algorithm.adv_estimator on this worker's sequences; returns (batch-wide metrics, mean KL per sequence).

    With algorithm.use_kl_in_reward the token rewards get ``- kl_coef * KL(old || ref)``.
    """
    mask = pad_field([s.loss_mask for s in seqs]) if seqs else torch.zeros(0, 1)
    token_rewards = turn_token_rewards(seqs, mask)
    metrics, kl_mean = {}, 0.0
    if algo.use_kl_in_reward:
        if seqs and (seqs[0].ref_log_probs is None or seqs[0].old_log_probs is None):
            raise ValueError("algorithm.use_kl_in_reward needs old and reference log-probs")
        old = pad_field([s.old_log_probs for s in seqs]) if seqs else mask
        ref = pad_field([s.ref_log_probs for s in seqs]) if seqs else mask
        kl = kl_penalty(old, ref, algo.kl_penalty) * mask
        token_rewards = apply_kl_in_reward(token_rewards, kl, kl_coef, mask)
        per_seq = kl.sum(-1) / mask.sum(-1).clamp(min=1)
        tot = all_reduce(torch.tensor([float(kl.sum()), float(mask.sum()), float(per_seq.sum()), len(seqs)],
                                      dtype=torch.float64))
        metrics["reward/kl_penalty"] = float(tot[0] / tot[1].clamp(min=1))
        metrics["reward/kl_coef"] = kl_coef
        kl_mean = float(tot[2] / tot[3].clamp(min=1))
    for s, r in zip(seqs, token_rewards):
        s.extra["final_reward"] = float(r.sum())
    # Every rank runs the estimator, an empty one too: whitening estimators all-reduce inside
    # (masked_whiten), so a rank that skipped it would leave the others' collectives out of step.
    values = None
    if needs_critic(algo.adv_estimator):
        values = pad_field([s.old_values for s in seqs]) if seqs else torch.zeros_like(mask)
    adv, ret = compute_advantages(
        algo.adv_estimator, response_mask=mask, token_rewards=token_rewards, group_index=[s.uid for s in seqs],
        values=values, gamma=algo.gamma, lam=algo.lam, norm_adv_by_std_in_grpo=algo.norm_adv_by_std_in_grpo,
        all_reduce=all_reduce, turn_index=turn_index(seqs, mask.shape[1]), turn_keys=[s.turn_keys for s in seqs],
        step_weight=algo.gigpo.step_weight, timestep_unit=algo.gae_timestep_unit,
        episode_norm=algo.gigpo.episode_norm, singleton_group=algo.gigpo.singleton_group,
    )  # fmt: skip
    for i, s in enumerate(seqs):
        s.advantages, s.returns = adv[i, : s.response_len].clone(), ret[i, : s.response_len].clone()
    abs_sum = float((adv.abs() * mask).sum())
    tot = all_reduce(torch.tensor([abs_sum, float(mask.sum())], dtype=torch.float64))
    metrics["actor/advantage_abs_mean"] = float(tot[0] / tot[1].clamp(min=1))
    return metrics, kl_mean


def _spans(s: TrainSeq) -> list[tuple[int, int]]:
    """The sequence's turns, or one turn over the whole response when it has none (offline data)."""
    return s.turns or [(0, s.response_len)]


def turn_token_rewards(seqs: list[TrainSeq], mask: torch.Tensor) -> torch.Tensor:
    """[B, T] token rewards: each turn's score on its last model token (or the closest model token before
    it), the rest of the reward (reward - sum of turn scores) on the row's last model token."""
    scores = torch.tensor([s.score - sum(s.turn_scores) for s in seqs], dtype=torch.float32)
    out = scores_to_token_rewards(scores, mask)
    for i, s in enumerate(seqs):
        model_pos = s.loss_mask.nonzero().flatten().tolist()
        for (_, end), score in zip(_spans(s), s.turn_scores):
            before = [p for p in model_pos if p < end]
            if score and (before or model_pos):
                out[i, before[-1] if before else model_pos[-1]] += score
    return out


def turn_index(seqs: list[TrainSeq], width: int) -> torch.Tensor:
    """[B, width] long: the turn of each response position (a turn runs from its first token to the next
    turn's first token; positions before the first turn count as turn 0), -1 on padding."""
    out = torch.full((len(seqs), width), -1, dtype=torch.long)
    for i, s in enumerate(seqs):
        starts = torch.tensor([start for start, _ in _spans(s)], dtype=torch.long)
        pos = torch.arange(s.response_len)
        out[i, : s.response_len] = (torch.searchsorted(starts, pos, right=True) - 1).clamp(min=0)
    return out


def filter_groups(seqs: list[TrainSeq], metric: str, all_reduce: AllReduce = _local
                  ) -> tuple[list[TrainSeq], float]:  # fmt: skip
    """DAPO dynamic sampling: drop groups whose `metric` is the same for all members; returns (kept, kept share).

    metric (algorithm.filter_groups.metric): score / seq_reward = the reward, seq_final_reward = the
    reward after the in-reward KL penalty, acc = success (reward >= 1).
    """
    if metric in ("score", "seq_reward"):
        values = [s.score for s in seqs]
    elif metric == "seq_final_reward":
        values = [s.extra["final_reward"] for s in seqs]
    elif metric == "acc":
        values = [float(s.score >= SUCCESS_THRESHOLD) for s in seqs]
    else:
        raise ValueError(f"algorithm.filter_groups.metric must be score, seq_reward, seq_final_reward or acc, "
                         f"got {metric!r}")
    keep = filter_uniform_groups(torch.tensor(values), [s.uid for s in seqs]).tolist() if seqs else []
    kept = [s for s, k in zip(seqs, keep) if k]
    tot = all_reduce(torch.tensor([len(kept), len(seqs)], dtype=torch.float64))
    return kept, float(tot[0] / tot[1].clamp(min=1))


def log_prob_metrics(seqs: list[TrainSeq], all_reduce: AllReduce = _local) -> dict[str, float]:
    """Entropy, KL to the reference, and engine-vs-actor log-prob agreement, over all workers' model tokens.

    Entropy and the agreement need the actor's old log-probs (absent on the on-policy shortcut).
    """
    have_old = bool(seqs) and seqs[0].old_log_probs is not None and "entropy" in seqs[0].extra
    have_ref = bool(seqs) and seqs[0].ref_log_probs is not None
    wsum = lambda f: sum(float((f(s) * s.loss_mask).sum()) for s in seqs)  # noqa: E731
    diff = lambda s: (s.rollout_log_probs - s.old_log_probs).abs()  # noqa: E731
    local = torch.tensor([
        sum(float(s.loss_mask.sum()) for s in seqs), float(have_old), float(have_ref),
        wsum(lambda s: s.extra["entropy"]) if have_old else 0.0,
        wsum(diff) if have_old else 0.0,
        wsum(lambda s: kl_penalty(s.old_log_probs, s.ref_log_probs, "low_var_kl")) if have_old and have_ref else 0.0,
    ], dtype=torch.float64)  # fmt: skip
    dmax = max((float((diff(s) * s.loss_mask).max()) for s in seqs if s.response_len), default=0.0) if have_old else 0
    tot, top = all_reduce(local), all_reduce(torch.tensor([dmax], dtype=torch.float64), "max")
    tokens, out = float(tot[0]) or 1.0, {}
    if tot[1] > 0:
        out["actor/entropy"] = float(tot[3]) / tokens
        out["rollout/actor_logprob_diff_mean"] = float(tot[4]) / tokens
        out["rollout/actor_logprob_diff_max"] = float(top[0])
        if tot[2] > 0:
            out["actor/kl"] = float(tot[5]) / tokens
    return out



def rollout_is_weights(old_log_probs: Tensor, rollout_log_probs: Tensor, mask: Tensor, level: str, threshold: float
                       ) -> tuple[Tensor, Tensor]:  # fmt: skip
    """Capped importance weights pi_old / pi_engine per token (token), or each sequence's capped product of
    ratios on every token (sequence); 0 off the loss mask. Takes one sequence [T] or a padded batch [B, T]
    (a sequence per row). Returns (weights, uncapped weights)."""
    mask = mask.bool()
    log_ratio = torch.where(mask, old_log_probs - rollout_log_probs, 0.0)
    if level == "token":
        raw = log_ratio.exp()
    elif level == "sequence":
        raw = log_ratio.sum(-1, keepdim=True).exp().expand_as(log_ratio)
    else:
        raise ValueError(f"algorithm.rollout_correction.rollout_is must be token or sequence, got {level!r}")
    return torch.where(mask, raw.clamp(max=threshold), 0.0), raw


def add_rollout_is_stats(stats: Tensor, weights: Tensor, raw: Tensor, mask: Tensor, threshold: float) -> None:
    """Add a sequence or a padded batch to `stats` = [sum of weights, tokens, capped tokens, max weight]
    (float64, in place)."""
    mask = mask.bool()
    top = weights.max() if weights.numel() else weights.new_zeros(())
    one = torch.stack([weights.sum(), mask.sum(), (mask & (raw > threshold)).sum(), top]).to(stats)
    stats[:3] += one[:3]
    stats[3] = torch.maximum(stats[3], one[3])


def rollout_is_metrics(stats: Tensor, all_reduce: AllReduce = _local) -> dict[str, float]:
    """The logged metrics from this rank's `add_rollout_is_stats` sums (max in the last entry), all ranks."""
    stats = stats.detach().cpu()
    top, tot = all_reduce(stats[3:].clone(), "max"), all_reduce(stats[:3].clone())
    tokens = float(tot[1]) or 1.0
    return {"rollout_is/weight_mean": float(tot[0]) / tokens, "rollout_is/weight_max": float(top[0]),
            "rollout_is/capped_fraction": float(tot[2]) / tokens}


def apply_rollout_correction(seqs: list[TrainSeq], level: str, threshold: float, all_reduce: AllReduce = _local
                             ) -> dict[str, float]:  # fmt: skip
    """Decoupled PPO / truncated importance sampling: scale each token's advantage by the capped weight
    pi_old / pi_engine (token) or by its sequence's capped product of ratios (sequence).

    Scaling the advantage by w > 0 is the same as weighting the token's clipped PPO term by w, so the
    loss functions stay untouched. Needs the actor's old log-probs (recomputed) and the engine's; on the
    on-policy shortcut (no old log-probs) the update applies the same weights itself (`update_actor`).
    """
    stats = torch.zeros(4, dtype=torch.float64)
    for s in seqs:
        w, raw = rollout_is_weights(s.old_log_probs, s.rollout_log_probs, s.loss_mask, level, threshold)
        s.advantages = s.advantages * w
        add_rollout_is_stats(stats, w, raw, s.loss_mask, threshold)
    return rollout_is_metrics(stats, all_reduce)
