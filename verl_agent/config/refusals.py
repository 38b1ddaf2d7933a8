"""Rules across sections: a verl key whose machinery does not exist here parses at its default, and a
non-default value is refused naming the key and what to use instead (`RunConfig`'s last check)."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from verl_agent.config.actor import ModelConfig
from verl_agent.config.algorithm import GiGPOConfig, KLCtrlConfig
from verl_agent.config.reward import JudgeConfig
from verl_agent.registry import LOGGERS

if TYPE_CHECKING:
    from verl_agent.config.run import RunConfig

__all__ = ["unimplemented"]

_Refuse = Callable[[bool, str, Any, str], None]  # refuse(when, key, value, what to use instead)


def unimplemented(c: RunConfig) -> list[tuple[str, Any, str]]:
    """(key, value, what to use instead) for every non-default value whose machinery does not exist here."""
    out: list[tuple[str, Any, str]] = []

    def refuse(when: bool, key: str, value: Any, hint: str) -> None:
        if when:
            out.append((key, value, hint))

    for step in (_refuse_modes, _refuse_placement, _refuse_verl_spellings, _refuse_fsdp_and_logger, _refuse_judge,
                 _refuse_lora, _refuse_context):
        step(c, refuse)
    return out


def _refuse_modes(c: RunConfig, refuse: _Refuse) -> None:
    """Resuming, devices, mini-batches and the keys only one trainer.mode reads."""
    arr, d, t = c.actor_rollout_ref, c.data, c.trainer
    r, is_level = arr.rollout, c.algorithm.rollout_correction.rollout_is
    refuse(t.resume_from_path is not None and t.resume_mode != "resume_path", "trainer.resume_from_path",
           t.resume_from_path, f"only trainer.resume_mode=resume_path uses it (resume_mode is {t.resume_mode})")
    refuse(t.device == "cuda" and t.n_gpus_per_node == 0, "trainer.device", "cuda",
           "set trainer.n_gpus_per_node (0 means CPU workers)")
    mini = arr.actor.ppo_mini_batch_size
    refuse(mini < d.train_batch_size and d.train_batch_size % mini != 0, "actor_rollout_ref.actor.ppo_mini_batch_size",
           mini, f"must divide data.train_batch_size ({d.train_batch_size}) into whole mini-batches")
    refuse(arr.actor.old_log_prob_source == "rollout" and is_level != "none" and (is_level != "auto" or t.mode != "sync"),
           "actor_rollout_ref.actor.old_log_prob_source", "rollout",
           f"the rollout correction (algorithm.rollout_correction.rollout_is={is_level}, mode {t.mode}) weighs the "
           "engine's log-probs against the actor's: use auto or actor, or set rollout_is=none")
    refuse(t.mode != "async" and t.max_staleness != 1, "trainer.max_staleness", t.max_staleness,
           f"only trainer.mode=async uses it (sync is 0 and one_step_off 1 by construction; mode is {t.mode})")
    refuse(t.mode != "async" and not t.partial_rollout, "trainer.partial_rollout", False,
           f"only trainer.mode=async uses it (one_step_off always lets started trajectories finish; mode is {t.mode})")
    refuse(r.mode != "async", "actor_rollout_ref.rollout.mode", r.mode,
           "the agent loop always runs trajectories concurrently; leave it at async")


def _refuse_placement(c: RunConfig, refuse: _Refuse) -> None:
    """Keys that only one trainer.placement reads, and layouts that are fixed here."""
    arr, t = c.actor_rollout_ref, c.trainer
    r = arr.rollout
    refuse(not arr.hybrid_engine and t.placement == "colocated", "actor_rollout_ref.hybrid_engine", False,
           "without the colocated hybrid engine, set trainer.placement=split (and trainer.rollout_workers)")
    refuse(t.placement == "colocated" and t.rollout_workers != 1, "trainer.rollout_workers", t.rollout_workers,
           "only trainer.placement=split uses it (colocated: one engine per train worker)")
    refuse(t.placement == "colocated" and t.weight_transport != "auto", "trainer.weight_transport",
           t.weight_transport, "only trainer.placement=split sends weights between processes")
    refuse((t.placement == "colocated" or t.n_gpus_per_node == 0) and t.rollout_gpus_per_worker != 1.0,
           "trainer.rollout_gpus_per_worker", t.rollout_gpus_per_worker,
           "only trainer.placement=split on GPUs uses it")
    refuse(r.tensor_model_parallel_size != 1, "actor_rollout_ref.rollout.tensor_model_parallel_size",
           r.tensor_model_parallel_size, "each worker runs one engine replica; use 1")
    refuse(not arr.model.use_remove_padding, "actor_rollout_ref.model.use_remove_padding", False,
           "sequences are always packed without padding; leave it true")
    refuse(not c.data.return_raw_chat, "data.return_raw_chat", False, "the agent loop always keeps the chat messages")


def _refuse_verl_spellings(c: RunConfig, refuse: _Refuse) -> None:
    """verl's deprecated keys, and algorithm keys the chosen estimator does not read."""
    arr, a, d = c.actor_rollout_ref, c.algorithm, c.data
    r = arr.rollout
    for key, value in [("actor_rollout_ref.actor.ppo_micro_batch_size", arr.actor.ppo_micro_batch_size),
                       ("actor_rollout_ref.rollout.log_prob_micro_batch_size", r.log_prob_micro_batch_size),
                       ("actor_rollout_ref.ref.log_prob_micro_batch_size", arr.ref.log_prob_micro_batch_size),
                       ("critic.ppo_micro_batch_size", c.critic.ppo_micro_batch_size)]:
        refuse(value is not None, key, value, f"verl's deprecated global size; use {key}_per_gpu")
    refuse(a.kl_ctrl != KLCtrlConfig() and not a.use_kl_in_reward, "algorithm.kl_ctrl", a.kl_ctrl.model_dump(),
           "kl_ctrl sets the in-reward KL penalty: set algorithm.use_kl_in_reward=true (or use "
           "actor_rollout_ref.actor.use_kl_loss with kl_loss_coef)")
    refuse(a.gae_timestep_unit != "token" and a.adv_estimator != "gae", "algorithm.gae_timestep_unit",
           a.gae_timestep_unit, f"only adv_estimator=gae uses it (adv_estimator is {a.adv_estimator}; "
           "grpo_turn and gigpo are turn-level already)")
    refuse(a.gigpo != GiGPOConfig() and a.adv_estimator != "gigpo", "algorithm.gigpo", a.gigpo.model_dump(),
           f"only adv_estimator=gigpo uses it (adv_estimator is {a.adv_estimator})")
    refuse(r.prompt_length is not None and r.prompt_length != d.max_prompt_length,
           "actor_rollout_ref.rollout.prompt_length", r.prompt_length, "set data.max_prompt_length instead")
    refuse(r.response_length is not None and r.response_length != d.max_response_length,
           "actor_rollout_ref.rollout.response_length", r.response_length, "set data.max_response_length instead")


def _refuse_context(c: RunConfig, refuse: _Refuse) -> None:
    """The native loop's context strategy and budgets; an agent function manages its own history."""
    r = c.actor_rollout_ref.rollout
    if r.agent.entrypoint is None:
        return
    mt, key = r.multi_turn, "actor_rollout_ref.rollout.multi_turn"
    hint = ("the native agent loop reads it; an agent function (rollout.agent.entrypoint) keeps its own history: "
            "its rewrites become segments, its budget is data.max_response_length")
    refuse(mt.context.strategy != "none", f"{key}.context.strategy", mt.context.strategy, hint)
    refuse(mt.history != "exact", f"{key}.history", mt.history, "the native agent loop reads it; the OpenAI "
           "endpoint records what the agent sends and starts a new segment wherever its history is rewritten")
    for name in ("max_tokens_per_turn", "max_total_tokens", "max_context_length"):
        refuse(getattr(mt, name) is not None, f"{key}.{name}", getattr(mt, name), hint)


def _refuse_fsdp_and_logger(c: RunConfig, refuse: _Refuse) -> None:
    """Sharding and offload layouts that are not implemented, and loggers we do not have."""
    arr = c.actor_rollout_ref
    gpu = c.trainer.n_gpus_per_node > 0 and c.trainer.device != "cpu"
    for name, fsdp in [("actor", arr.actor.fsdp_config), ("ref", arr.ref.fsdp_config)]:
        key = f"actor_rollout_ref.{name}.fsdp_config"
        refuse(fsdp.fsdp_size not in (-1, c.world_size), f"{key}.fsdp_size", fsdp.fsdp_size,
               f"HSDP is not implemented: use -1 (shard over all {c.world_size} workers)")
        refuse(fsdp.param_offload and not gpu, f"{key}.param_offload", True,
               "FSDP2 CPU offload needs GPU workers (trainer.n_gpus_per_node > 0); on CPU everything is on CPU")
        refuse(fsdp.param_offload and gpu and c.world_size > 1, f"{key}.param_offload", True,
               f"CPU offload runs on one GPU only ({c.world_size} workers here): with several, gradient clipping and "
               "the weight push would run NCCL collectives on CPU tensors")
        refuse(fsdp.optimizer_offload and not fsdp.param_offload, f"{key}.optimizer_offload", True,
               "FSDP2 offloads parameters, gradients and optimizer state together: set param_offload=true")
    refuse(any(name not in LOGGERS for name in c.trainer.logger), "trainer.logger", c.trainer.logger,
           f"registered loggers: {', '.join(LOGGERS.names())} (metrics.jsonl is always written)")
    for name in ("wandb", "mlflow"):  # optional extras: say so before any worker starts
        refuse(name in c.trainer.logger and importlib.util.find_spec(name) is None, "trainer.logger", name,
               f"the {name} package is not installed: pip install verl-agent[{name}]")


def _refuse_judge(c: RunConfig, refuse: _Refuse) -> None:
    """reward_model: the judge needs its URL and model; its keys do nothing without enable; one reward source."""
    rm = c.reward_model
    refuse(not rm.enable and rm.judge != JudgeConfig(), "reward_model.judge", rm.judge.model_dump(exclude_defaults=True),
           "only reward_model.enable=true uses it")
    refuse(not rm.enable and rm.model.path is not None, "reward_model.model.path", rm.model.path,
           "only reward_model.enable=true uses it (the judge's model name)")
    refuse(rm.enable and not rm.judge.api_base, "reward_model.enable", True,
           "set reward_model.judge.api_base to the judge's OpenAI-compatible URL (e.g. http://127.0.0.1:8000/v1)")
    refuse(rm.enable and not rm.model.path, "reward_model.enable", True,
           "set reward_model.model.path to the judge's model name")
    own = c.data.reward_fn or c.custom_reward_function.path
    refuse(rm.enable and bool(own), "reward_model.enable", True,
           f"the judge gives the reward, and a reward function is set too ({own}): to mix the judge with your own "
           "scoring, call verl_agent.judge.Judge from your compute_score and leave reward_model.enable=false")


def _refuse_lora(c: RunConfig, refuse: _Refuse) -> None:
    """LoRA keys without lora_rank, and what does not run with adapters."""
    m, t = c.actor_rollout_ref.model, c.trainer
    defaults = ModelConfig()
    if m.lora_rank == 0:
        for key in ("lora_alpha", "target_modules", "exclude_modules", "lora_adapter_path"):
            refuse(getattr(m, key) != getattr(defaults, key), f"actor_rollout_ref.model.{key}", getattr(m, key),
                   "only LoRA reads it: set actor_rollout_ref.model.lora_rank > 0")
        refuse(t.export_merged_model, "trainer.export_merged_model", True,
               "without LoRA the export is the full model already (set actor_rollout_ref.model.lora_rank > 0)")
    refuse(m.lora_rank > 0 and c.actor_rollout_ref.rollout.name == "sglang", "actor_rollout_ref.model.lora_rank",
           m.lora_rank, "SGLang 0.5.23 serves LoRA adapters on GPU only (its LoRA layers pin host memory, which "
           "needs a CUDA driver), and the adapter sync into SGLang is not implemented: use "
           "actor_rollout_ref.rollout.name=hf with LoRA")
