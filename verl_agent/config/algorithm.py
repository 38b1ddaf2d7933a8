"""algorithm: the advantage estimator and its settings, the in-reward KL penalty, group filtering and the
rollout correction (read by `trainer/algorithms` and `trainer/policy`)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, Field

from verl_agent.config.base import Section
from verl_agent.registry import ADV_ESTIMATORS

__all__ = ["AlgorithmConfig", "FilterGroupsConfig", "GiGPOConfig", "KLCtrlConfig", "RolloutCorrectionConfig"]

# a registered estimator's name (verl_agent/registry.py); an unknown name's error lists the registered ones
EstimatorName = Annotated[str, AfterValidator(ADV_ESTIMATORS.check)]


class KLCtrlConfig(Section):
    """Coefficient of the KL penalty in the reward (algorithm.use_kl_in_reward); adaptive = verl's controller."""

    type: Literal["fixed", "adaptive"] = "fixed"
    kl_coef: float = Field(0.001, ge=0)
    target_kl: float = Field(0.1, gt=0)
    horizon: int = Field(10000, ge=1)


class FilterGroupsConfig(Section):
    enable: bool = False
    metric: Literal["score", "seq_reward", "seq_final_reward", "acc"] = Field(
        "score", description="what must differ within a group to keep it: score/seq_reward (the reward), "
        "seq_final_reward (reward minus the in-reward KL penalty), acc (success: reward >= 1)")


class RolloutCorrectionConfig(Section):
    """Truncated importance sampling between the engine's policy (which sampled) and PPO's old policy.

    Decoupled PPO: the PPO ratio is taken against the actor's recomputed log-probs, and each token's
    advantage is scaled by w = min(pi_old / pi_engine, rollout_is_threshold) (token) or by the
    sequence's product of ratios, truncated (sequence). Needed when rollouts are stale (async modes).
    """

    rollout_is: Literal["auto", "none", "token", "sequence"] = Field(
        "auto", description="auto: token in one_step_off/async modes, none in sync")
    rollout_is_threshold: float = Field(2.0, gt=0, description="cap of the importance weight")


class GiGPOConfig(Section):
    """GiGPO (algorithm.adv_estimator=gigpo): episode-level group advantage + step_weight x step-level one."""

    step_weight: float = Field(1.0, ge=0, description="weight of the step-level advantage (turns of a group that "
                               "start from the same observation or interaction state key, compared by their "
                               "discounted returns); 0: the episode-level GRPO advantage alone")
    episode_norm: Literal["trajectory", "step"] = Field(
        "trajectory", description="the episode-level advantage's group mean and std: over the group's trajectories "
        "(the paper's formula) or over its step rows, one per assistant turn with the trajectory's reward (the "
        "authors' code's default: longer trajectories weigh more)")
    singleton_group: Literal["verl", "zero"] = Field(
        "verl", description="episode-level advantage of a group of one entry: verl's rule (mean 0, std 1: its "
        "reward R; with episode_norm=step a lone trajectory of several turns gets 0, as in the authors' code), "
        "or zero: 0 for every group of one trajectory")


class AlgorithmConfig(Section):
    adv_estimator: EstimatorName = Field(
        "grpo", description="a registered estimator: grpo | rloo | reinforce_plus_plus | reinforce_plus_plus_baseline "
        "| gae | grpo_turn | gigpo | your own (verl_agent/registry.py); grpo_turn / gigpo (and gae with "
        "gae_timestep_unit=turn) give credit per assistant turn")
    gamma: float = Field(1.0, description="discount per model token (token estimators) or per assistant turn "
                         "(grpo_turn, gigpo, gae with gae_timestep_unit=turn)")
    lam: float = 1.0
    gae_timestep_unit: Literal["token", "turn"] = Field(
        "token", description="gae's time step: each model token, or each assistant turn (the critic's value read "
        "at the turn's first token, one reward per turn)")
    gigpo: GiGPOConfig = Field(default_factory=GiGPOConfig)
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: Literal["k1", "kl", "abs", "k2", "mse", "low_var_kl", "k3"] = "kl"
    kl_ctrl: KLCtrlConfig = Field(default_factory=KLCtrlConfig)
    filter_groups: FilterGroupsConfig = Field(default_factory=FilterGroupsConfig)
    rollout_correction: RolloutCorrectionConfig = Field(default_factory=RolloutCorrectionConfig)
