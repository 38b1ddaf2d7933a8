"""Driver-side data steps between rollout and update: trajectories -> TrainSeqs -> advantages -> metrics.

Each rank trains on the trajectories it rolled out itself (its GRPO groups are
complete there), so shards stay aligned with ranks; advantages are computed on
the driver over the whole batch with the registered estimator.
"""

from __future__ import annotations

import torch

from verl_agent.protocol import Trajectory
from verl_agent.trainer.algorithms import (
    apply_kl_in_reward, compute_advantages, filter_uniform_groups, kl_penalty, scores_to_token_rewards,
)
from verl_agent.trainer.batch import TrainSeq, from_trajectory, pad_field

__all__ = ["to_train_shards", "attach", "assign_advantages", "filter_groups", "train_metrics"]


def to_train_shards(shards: list[list[Trajectory]]) -> tuple[list[list[TrainSeq]], int]:
    """Per-rank TrainSeqs; trajectories without prompt or response tokens are dropped (returned count)."""
    out, dropped = [], 0
    for trajs in shards:
        keep = [t for t in trajs if t.prompt_ids and t.response_ids]
        dropped += len(trajs) - len(keep)
        out.append([from_trajectory(t) for t in keep])
    return out, dropped


def attach(shards: list[list[TrainSeq]], outputs: list[list[dict]]) -> None:
    """Store compute_log_probs results (old/ref log-probs, values, entropy) on the sequences."""
    for seqs, outs in zip(shards, outputs):
        for s, o in zip(seqs, outs):
            s.old_log_probs, s.ref_log_probs = o["old_log_probs"], o.get("ref_log_probs")
            s.old_values = o.get("old_values")
            s.extra["entropy"] = o["entropy"]


def assign_advantages(seqs: list[TrainSeq], algo) -> dict[str, float]:
    """Run ``algorithm.adv_estimator`` over the whole batch and write advantages/returns per sequence."""
    if not seqs:
        return {}
    mask = pad_field([s.loss_mask for s in seqs])
    scores = torch.tensor([s.score for s in seqs], dtype=torch.float32)
    token_rewards = scores_to_token_rewards(scores, mask)
    metrics = {}
    if algo.use_kl_in_reward:
        if seqs[0].ref_log_probs is None:
            raise ValueError("algorithm.use_kl_in_reward needs reference log-probs (the worker builds a ref model)")
        old, ref = pad_field([s.old_log_probs for s in seqs]), pad_field([s.ref_log_probs for s in seqs])
        kl = kl_penalty(old, ref, algo.kl_penalty)
        token_rewards = apply_kl_in_reward(token_rewards, kl, algo.kl_ctrl.kl_coef, mask)
        metrics["reward/kl_penalty"] = float((kl * mask).sum() / mask.sum().clamp(min=1))
    values = pad_field([s.old_values for s in seqs]) if algo.adv_estimator == "gae" else None
    adv, ret = compute_advantages(
        algo.adv_estimator, response_mask=mask, token_rewards=token_rewards, group_index=[s.uid for s in seqs],
        values=values, gamma=algo.gamma, lam=algo.lam, norm_adv_by_std_in_grpo=algo.norm_adv_by_std_in_grpo,
    )  # fmt: skip
    for i, s in enumerate(seqs):
        s.advantages, s.returns = adv[i, : s.response_len].clone(), ret[i, : s.response_len].clone()
    metrics["actor/advantage_abs_mean"] = float((adv.abs() * mask).sum() / mask.sum().clamp(min=1))
    return metrics


def filter_groups(shards: list[list[TrainSeq]]) -> tuple[list[list[TrainSeq]], float]:
    """DAPO dynamic sampling: drop groups whose scores are all equal; returns (shards, kept fraction)."""
    flat = [s for seqs in shards for s in seqs]
    if not flat:
        return shards, 0.0
    keep = filter_uniform_groups(torch.tensor([s.score for s in flat]), [s.uid for s in flat]).tolist()
    kept = {id(s) for s, k in zip(flat, keep) if k}
    return [[s for s in seqs if id(s) in kept] for seqs in shards], len(kept) / len(flat)


def train_metrics(seqs: list[TrainSeq]) -> dict[str, float]:
    """Entropy, KL to the reference, and rollout-vs-actor log-prob agreement over model tokens."""
    if not seqs:
        return {}
    tokens = sum(float(s.loss_mask.sum()) for s in seqs) or 1.0
    wsum = lambda f: sum(float((f(s) * s.loss_mask).sum()) for s in seqs) / tokens  # noqa: E731
    out = {"actor/entropy": wsum(lambda s: s.extra["entropy"])}
    diffs = [((s.rollout_log_probs - s.old_log_probs).abs() * s.loss_mask)
             for s in seqs if s.rollout_log_probs is not None and s.response_len]
    if diffs:  # engine vs actor on the same tokens: a health check of the weight sync
        out["rollout/actor_logprob_diff_mean"] = sum(float(d.sum()) for d in diffs) / tokens
        out["rollout/actor_logprob_diff_max"] = max(float(d.max()) for d in diffs)
    if seqs[0].ref_log_probs is not None:
        out["actor/kl"] = wsum(lambda s: kl_penalty(s.old_log_probs, s.ref_log_probs, "low_var_kl"))
    return out
