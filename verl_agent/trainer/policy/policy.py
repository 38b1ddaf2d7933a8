"""`Policy`: one train rank's share of the models being trained and the passes that train them.

The actor (+ ref, + critic) is sharded with FSDP2 over the train ranks' process group. A step's
sequences stay on the rank that holds them; `compute_log_probs`, `compute_advantages` and `update`
work on them in place and answer with batch-wide metrics (all-reduced: the same on every rank).
GRPO groups are whole on one rank, so group advantages are local. Every method is collective.
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from verl_agent.trainer.policy.actor import (
    MicroBatching, forward_log_probs, forward_values, micro_batches, reduce_op, update_actor, update_critic,
)
from verl_agent.trainer.algorithms.advantage_base import needs_critic
from verl_agent.trainer.policy.batch import TrainSeq
from verl_agent.engine.runner.decode_step import place_back_to_back
from verl_agent.engine.runner.fused_norms import fuse_norms
from verl_agent.trainer.policy.fsdp import iter_full_param_buckets, load_causal_lm, make_scheduler, shard
from verl_agent.trainer.policy.memory import plan_memory
from verl_agent.trainer.policy.shared_prefix import supports_packing
from verl_agent.trainer.policy.prepare import apply_rollout_correction, assign_advantages, filter_groups, log_prob_metrics
from verl_agent.trainer.weights.shared_weights import engine_shares_weights

if TYPE_CHECKING:
    from verl_agent.config import RunConfig

logger = logging.getLogger(__name__)

__all__ = ["AdvantageResult", "Policy", "old_log_probs_from_actor", "rollout_is_level", "shared_prefix_tokens"]


@dataclass
class AdvantageResult:
    """What `compute_advantages` tells the driver: metrics, the in-reward KL and the batch's size."""

    metrics: dict[str, float]
    kl: float  # batch mean of the per-sequence KL in the reward (for the adaptive KL controller)
    sequences: int  # sequences of the whole batch that enter the update


def old_log_probs_from_actor(actor_cfg: Any, n_minibatches: int, kl_in_reward: bool) -> bool:
    """Does PPO's old log-prob need its own actor forward pass? (actor.old_log_prob_source)

    auto: only when the batch is not trained in one optimizer step (several epochs or
    mini-batches), or when the in-reward KL needs it; otherwise the update uses its own
    log-probs, detached (ratio 1: the same gradient, one forward pass fewer). That holds in the
    async modes too: the old policy of decoupled PPO is the actor before this update, whatever
    weights the engine sampled with, and the rollout correction's weight pi_old / pi_engine is
    then taken inside the update (`update_actor(rollout_is=...)`).
    """
    src = actor_cfg.old_log_prob_source
    if src == "actor":
        return True
    if src == "rollout":
        return False
    return actor_cfg.ppo_epochs > 1 or n_minibatches > 1 or kl_in_reward


def rollout_is_level(cfg: RunConfig) -> str:
    """algorithm.rollout_correction.rollout_is with auto resolved: token in the async modes, none in sync."""
    level = cfg.algorithm.rollout_correction.rollout_is
    if level == "auto":
        return "none" if cfg.trainer.mode == "sync" else "token"
    return level


# Shared prefixes skip matmul work but attend through a dense mask: a net gain where the update is
# matmul-bound (large hidden sizes), a loss where small kernels and launches dominate it.
SHARED_PREFIX_MIN_HIDDEN = 2048
SHARED_PREFIX_DEFAULT_TOKENS = 32


def shared_prefix_tokens(setting: int | None, model: torch.nn.Module) -> int:
    """actor.shared_prefix_min_tokens with None resolved for `model` (see SHARED_PREFIX_MIN_HIDDEN); 0 where
    the model cannot take packed rows, so that micro-batches are budgeted as the padded rows they run."""
    if not supports_packing(model):
        if setting:
            logger.warning("actor.shared_prefix_min_tokens=%d: this model's attention (%s, or sliding-window "
                           "layers) takes no custom 4-D mask; padded rows are used", setting,
                           getattr(getattr(model, "config", None), "_attn_implementation", None))
        return 0
    if setting is not None:
        return setting
    hidden = getattr(getattr(model, "config", None), "hidden_size", 0) or 0
    return SHARED_PREFIX_DEFAULT_TOKENS if hidden >= SHARED_PREFIX_MIN_HIDDEN else 0


class Policy:
    """The sharded actor (+ ref for the KL, + critic for GAE) of one train rank, their optimizers and LR
    schedules, and the training passes over this rank's sequences: log-probs, advantages, update."""

    def __init__(self, cfg: RunConfig, rank: int, device: torch.device, mesh: Any, model_path: str) -> None:
        self.cfg, self.rank, self.device, self.mesh, self.model_path = cfg, rank, device, mesh, model_path
        arr = cfg.actor_rollout_ref
        a, fc = arr.actor, arr.actor.fsdp_config
        self.lora = arr.model.lora_rank > 0
        shared = engine_shares_weights(cfg, device.type, mesh.size())
        self.actor = shard(self._load(arr.model.enable_gradient_checkpointing, fc.param_offload, self.lora, shared),
                           mesh, device.type, fc.reshard_after_forward, fc.param_offload)
        self.optim, self.sched = self._optimizer(self.actor, a.optim)
        self.ref: torch.nn.Module | None = None  # with LoRA the reference is the actor, adapters switched off
        self.needs_ref = a.use_kl_loss or cfg.algorithm.use_kl_in_reward
        if self.needs_ref and not self.lora:
            rc = arr.ref.fsdp_config
            self.ref = shard(self._load(False, rc.param_offload).eval().requires_grad_(False), mesh, device.type,
                             rc.reshard_after_forward, rc.param_offload)
        # the micro-batch token budget and the engine's KV budget that fit this device (collective)
        self.memory = plan_memory(cfg, self.actor, device, [m for m in (self.actor, self.ref) if m is not None])
        share = shared_prefix_tokens(a.shared_prefix_min_tokens, self.actor)
        self.mb = MicroBatching(a.use_dynamic_bsz, self.memory.max_tokens, a.ppo_micro_batch_size_per_gpu, share)
        self.mb_log_prob = MicroBatching(a.use_dynamic_bsz, self.memory.max_tokens,
                                         arr.rollout.log_prob_micro_batch_size_per_gpu or a.ppo_micro_batch_size_per_gpu,
                                         share)
        self.mb_ref = MicroBatching(a.use_dynamic_bsz, self.memory.max_tokens,
                                    arr.ref.log_prob_micro_batch_size_per_gpu or self.mb_log_prob.per_gpu, share)
        self.critic: torch.nn.Module | None = None
        if needs_critic(cfg.algorithm.adv_estimator):
            self._build_critic()
        self._rollout_is_in_update: tuple[str, float] | None = None  # (level, cap) when the update weighs them

    def _load(self, grad_ckpt: bool, offload: bool, lora: bool = False, shared: bool = False) -> torch.nn.Module:
        """The actor's (or reference's) model; `shared`: the colocated engine will read its tensors."""
        model_cfg = self.cfg.actor_rollout_ref.model
        # LoRA: the frozen base computes in bf16 on GPU and is stored so (no fp32 master copy to keep)
        dtype = "bfloat16" if lora and self.device.type == "cuda" else model_cfg.dtype
        model = load_causal_lm(self.model_path, dtype, grad_ckpt, model_cfg.trust_remote_code)
        if lora:
            from verl_agent.trainer.weights.lora import wrap_lora

            model = wrap_lora(model, model_cfg)
        model = model if offload else model.to(self.device)  # offloaded shards stay on the host
        fuse_norms(model)
        if shared and not lora:  # the engine reads q/k/v and gate/up as one product each (engine/runner/decode_step.py)
            place_back_to_back(model)
        return model

    def _optimizer(self, model: torch.nn.Module, optim_cfg: Any) -> tuple[torch.optim.Optimizer, Any]:
        # fused AdamW on GPU: no temporary the size of the weights (the foreach default needs one)
        trainable = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters alone
        opt = torch.optim.AdamW(trainable, lr=optim_cfg.lr, weight_decay=optim_cfg.weight_decay,
                                betas=tuple(optim_cfg.betas), fused=self.device.type == "cuda" and not
                                self.cfg.actor_rollout_ref.actor.fsdp_config.param_offload)
        return opt, make_scheduler(opt, optim_cfg, self.cfg.trainer.total_training_steps or 1)

    def _build_critic(self) -> None:
        from verl_agent.rollout.build import resolve_model_path
        from verl_agent.trainer.policy.fsdp import ValueModel

        c = self.cfg.critic
        path = resolve_model_path(c.model.path) if c.model.path else self.model_path
        critic = ValueModel(path, self.cfg.actor_rollout_ref.model.dtype, c.model.enable_gradient_checkpointing)
        self.critic = shard(critic.to(self.device), self.mesh, self.device.type)
        self.critic_optim, self.critic_sched = self._optimizer(self.critic, c.optim)
        # the critic's value head reads padded rows (ValueModel takes no position ids): no shared prefixes
        self.mb_critic = MicroBatching(self.mb.dynamic, self.mb.max_tokens, c.ppo_micro_batch_size_per_gpu)

    def memory_plan_info(self) -> dict[str, int]:
        """The planned micro-batch budget and the estimate behind it (reported by the worker's setup)."""
        return {"max_tokens": self.memory.max_tokens, "peak_estimate": self.memory.peak.total,
                "activations": self.memory.peak.activations}

    @property
    def num_parameters(self) -> int:
        """The actor's full parameter count (DTensor.numel() is the full size)."""
        return int(sum(p.numel() for p in self.actor.parameters()))

    @property
    def num_trainable_parameters(self) -> int:
        """Parameters the optimizer updates (with LoRA: the adapters')."""
        return int(sum(p.numel() for p in self.actor.parameters() if p.requires_grad))

    @property
    def agent_temperature(self) -> float:
        """The temperature the engine sampled with (0 = greedy: log-probs of the raw logits)."""
        r = self.cfg.actor_rollout_ref.rollout
        return r.temperature if r.do_sample else 0.0

    @torch.no_grad()
    def compute_log_probs(self, seqs: list[TrainSeq], n_minibatches: int) -> dict[str, float]:
        """Per sequence: old log-probs and entropy (actor, unless the on-policy shortcut applies), ref
        log-probs and values (critic) where configured. Returns batch-wide metrics."""
        cfg, arr = self.cfg, self.cfg.actor_rollout_ref
        temp = self.agent_temperature
        from_actor = old_log_probs_from_actor(arr.actor, n_minibatches, cfg.algorithm.use_kl_in_reward)
        level = rollout_is_level(cfg)  # decided from the config alone: the same on every rank
        self._rollout_is_in_update = (level, cfg.algorithm.rollout_correction.rollout_is_threshold) \
            if level != "none" and not from_actor else None
        if from_actor:
            self.actor.eval()
            for micro in micro_batches(seqs, self.mb_log_prob):
                logp, ent = forward_log_probs(self.actor, micro, temp, self.device, with_entropy=True,
                                              shared_prefix=self.mb_log_prob.shared_prefix)
                for s, lp, e in zip(micro, logp, ent):
                    s.old_log_probs, s.extra["entropy"] = lp.float().cpu(), e.float().cpu()
        elif arr.actor.old_log_prob_source == "rollout":
            for s in seqs:
                s.old_log_probs = s.rollout_log_probs
        if self.needs_ref:
            self._ref_log_probs(seqs, temp)
        if self.critic is not None:
            for micro in micro_batches(seqs, self.mb_critic):
                for s, v in zip(micro, forward_values(self.critic, micro, self.device)):
                    s.old_values = v.float().cpu()
        return log_prob_metrics(seqs, reduce_op)

    def _ref_log_probs(self, seqs: list[TrainSeq], temp: float) -> None:
        from verl_agent.trainer.weights.lora import reference_of

        self.actor.eval()
        with reference_of(self.actor) if self.ref is None else contextlib.nullcontext(self.ref) as ref:
            for micro in micro_batches(seqs, self.mb_ref):
                logp, _ = forward_log_probs(ref, micro, temp, self.device, shared_prefix=self.mb_ref.shared_prefix)
                for s, lp in zip(micro, logp):
                    s.ref_log_probs = lp.float().cpu()

    def compute_advantages(self, seqs: list[TrainSeq], kl_coef: float) -> tuple[list[TrainSeq], AdvantageResult]:
        """algorithm.adv_estimator on `seqs` (+ DAPO group filtering): the sequences that enter the update
        and the batch-wide result."""
        algo = self.cfg.algorithm
        metrics, kl = assign_advantages(seqs, algo, kl_coef, reduce_op)
        level = rollout_is_level(self.cfg)
        if level != "none" and self._rollout_is_in_update is None:
            metrics.update(apply_rollout_correction(seqs, level, algo.rollout_correction.rollout_is_threshold,
                                                    reduce_op))
        if algo.filter_groups.enable:
            seqs, metrics["train/kept_group_fraction"] = filter_groups(seqs, algo.filter_groups.metric, reduce_op)
        total = int(reduce_op(torch.tensor([len(seqs)], dtype=torch.float64))[0])
        return seqs, AdvantageResult(metrics=metrics, kl=kl, sequences=total)

    def update(self, seqs: list[TrainSeq], n_minibatches: int, step: int, update_actor_now: bool = True
               ) -> dict[str, float]:  # fmt: skip
        """Critic then actor updates on `seqs`; one LR-scheduler step each. Returns this rank's metrics."""
        arr, metrics = self.cfg.actor_rollout_ref, {}
        norm = self.cfg.data.max_response_length  # seq-mean-token-sum-norm's constant divisor (verl's padded width)
        seqs = list(seqs)
        if arr.actor.shuffle:  # the same order on a rerun: seeded by (seed, step, rank)
            random.Random(f"{self.cfg.trainer.seed}:{step}:{self.rank}").shuffle(seqs)
        if self.critic is not None:
            c = self.cfg.critic
            metrics.update(update_critic(self.critic, self.critic_optim, seqs, c, arr.actor.grad_clip, self.device,
                                         n_minibatches, c.ppo_epochs or arr.actor.ppo_epochs, self.mb_critic,
                                         loss_scale_factor=norm))
            self.critic_sched.step()
        if update_actor_now:
            metrics.update(update_actor(self.actor, self.optim, seqs, arr.actor, self.agent_temperature, self.device,
                                        n_minibatches, self.mb, loss_scale_factor=norm,
                                        rollout_is=self._rollout_is_in_update))
            metrics["lr"] = self.sched.get_last_lr()[0]
            self.sched.step()
        return metrics

    def engine_weights(self) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The actor's full parameters, bucket by bucket, in the engine replica's dtype (collective); with LoRA
        the adapter tensors alone (trainer/lora.py). An engine that reads the actor's parameters
        (weights/shared_weights.py) gets one empty bucket: it holds the update already, and loading nothing
        still orders it after the update and drops its stale KV."""
        arr = self.cfg.actor_rollout_ref
        if not self.lora and engine_shares_weights(self.cfg, self.device.type, self.mesh.size()):
            return iter([[]])
        dtype = getattr(torch, arr.rollout.dtype or arr.model.dtype)  # cast on the device
        bucket_bytes = (512 if self.device.type == "cuda" else 64) << 20
        if not self.lora:
            return iter_full_param_buckets(self.actor, bucket_bytes, dtype=dtype)
        from verl_agent.trainer.weights.lora import adapter_parameters, engine_adapter_tensors, lora_scaling

        # fp32 gathers, scaled, then cast: B x scaling rounds once, as the actor's forward does
        gathered = iter_full_param_buckets(self.actor, bucket_bytes, params=adapter_parameters(self.actor))
        return ([(n, t.to(dtype)) for n, t in b] for b in engine_adapter_tensors(gathered, lora_scaling(self.actor)))
