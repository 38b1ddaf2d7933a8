"""The RL algorithms of the trainer: one import point for pure tensor functions.

Conventions (all functions): tensors are padded ``[B, T]``; ``response_mask``
is 1 exactly on the model's own tokens and 0 on prompt padding, tool, user and
template tokens, which may sit in the middle of a multi-turn trajectory. Only
mask-1 tokens contribute to losses, metrics and gradients.

- advantages (``advantages.py``): ``compute_advantages(name, ...)`` over the
  ``ADV_ESTIMATORS`` registry: grpo (Dr. GRPO via norm_adv_by_std_in_grpo=False),
  rloo, reinforce_plus_plus, reinforce_plus_plus_baseline, gae, and the turn-level
  grpo_turn, gigpo and gae over turns (``turn_advantages.py``).
- losses (``losses.py``): ``POLICY_LOSSES`` (vanilla PPO clip-higher + dual
  clip, gspo), ``agg_loss``, ``kl_penalty``, ``entropy_from_logits``, ``value_loss``.
- ``actor_loss`` below: policy loss + entropy bonus + KL-to-reference loss, the
  whole objective of one actor micro-batch.
"""

from __future__ import annotations

from torch import Tensor

from verl_agent.trainer.algorithms.advantages import (
    ADV_ESTIMATORS, AdvantageInputs, AllReduce, KLController, apply_kl_in_reward, compute_advantages,
    filter_uniform_groups, get_adv_estimator, group_ids_from_index, make_kl_controller, masked_whiten,
    register_adv_estimator, scores_to_token_rewards,
)
from verl_agent.trainer.algorithms.losses import (
    KL_PENALTIES, LOSS_AGG_MODES, POLICY_LOSSES, PolicyLossFn, agg_loss, compute_policy_loss,
    entropy_from_logits, get_policy_loss, gspo_policy_loss, kl_penalty, masked_mean, masked_sum,
    register_policy_loss, value_loss, vanilla_policy_loss,
)

__all__ = [
    "ADV_ESTIMATORS", "AdvantageInputs", "apply_kl_in_reward", "compute_advantages", "filter_uniform_groups",
    "get_adv_estimator", "group_ids_from_index", "masked_whiten", "register_adv_estimator",
    "scores_to_token_rewards", "AllReduce", "KLController", "make_kl_controller", "KL_PENALTIES", "LOSS_AGG_MODES", "POLICY_LOSSES", "PolicyLossFn", "agg_loss",
    "compute_policy_loss", "entropy_from_logits", "get_policy_loss", "gspo_policy_loss", "kl_penalty",
    "masked_mean", "masked_sum", "register_policy_loss", "value_loss", "vanilla_policy_loss", "actor_loss",
]


def actor_loss(
    old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor, *,
    loss_mode: str = "vanilla", clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = 3.0, loss_agg_mode: str = "token-mean",
    entropy: Tensor | None = None, entropy_coeff: float = 0.0,
    ref_log_prob: Tensor | None = None, kl_loss_coef: float = 0.0, kl_loss_type: str = "low_var_kl",
    global_token_count: float | Tensor | None = None, global_seq_count: float | Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """pg_loss - entropy_coeff * entropy + kl_loss_coef * KL(pi || ref), each aggregated by ``loss_agg_mode``.

    ``entropy`` is the per-token entropy [B, T] (``entropy_from_logits``), used
    when ``entropy_coeff`` != 0; ``ref_log_prob`` is used when ``kl_loss_coef``
    != 0 (``actor.use_kl_loss``). The global counts and ``loss_scale_factor`` make
    micro-batch losses summable (see ``agg_loss``). Metrics: pg_loss, pg_clipfrac, ppo_kl,
    pg_clipfrac_lower, and entropy / kl_loss when used (detached).
    """
    counts = {"global_token_count": global_token_count, "global_seq_count": global_seq_count,
              "loss_scale_factor": loss_scale_factor}
    pg, metrics = compute_policy_loss(
        loss_mode, old_log_prob, log_prob, advantages, response_mask, clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c, loss_agg_mode=loss_agg_mode, **counts)
    metrics = {"pg_loss": pg.detach(), **metrics}
    loss = pg
    if entropy_coeff != 0.0:
        if entropy is None:
            raise ValueError("actor_loss: entropy_coeff != 0 needs the per-token entropy [B, T]")
        ent = agg_loss(entropy, response_mask, loss_agg_mode, **counts)
        loss = loss - entropy_coeff * ent
        metrics["entropy"] = ent.detach()
    if kl_loss_coef != 0.0:
        if ref_log_prob is None:
            raise ValueError("actor_loss: kl_loss_coef != 0 (use_kl_loss) needs ref_log_prob [B, T]")
        kl = agg_loss(kl_penalty(log_prob, ref_log_prob, kl_loss_type), response_mask, loss_agg_mode, **counts)
        loss = loss + kl_loss_coef * kl
        metrics["kl_loss"] = kl.detach()
    return loss, metrics
