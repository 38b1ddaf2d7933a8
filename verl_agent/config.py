"""The run configuration: a typed tree with verl's key names, loaded from YAML plus `a.b.c=value` overrides.

    cfg = load_config("examples/calculator/config.yaml", ["data.train_batch_size=8", "trainer.logger=[console]"])

Every section is a small pydantic model that forbids unknown keys, so a typo fails fast with the closest
valid key named (`ConfigError`). Keys follow verl wherever the concept is the same, so a verl user's
command line (`actor_rollout_ref.actor.optim.lr=1e-6 algorithm.adv_estimator=grpo ...`) reads as-is.
Every key works or is refused: verl keys whose machinery does not exist here (e.g. `rollout.mode=sync`,
`tensor_model_parallel_size=2`, HSDP via `fsdp_size`) parse at their default values, and a non-default
value is a `ConfigError` naming the key and what to use instead (`_refuse_unimplemented`).
"""

from __future__ import annotations

import difflib
import importlib.util
import re
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from verl_agent.engine.settings import HFEngineSettings
from verl_agent.imports import import_module
from verl_agent.judge import DEFAULT_SCORE_PATTERN, DEFAULT_SCORING_PROMPT, check_score_pattern, check_scoring_prompt
from verl_agent.registry import (
    ADV_ESTIMATORS, CONTEXT_STRATEGIES, ENGINES, LOGGERS, POLICY_LOSSES, REWARD_MANAGERS,
)

__all__ = ["ConfigError", "RunConfig", "load_config", "parse_override", "save_config", "all_keys"]


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the key and what is wrong."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


# Keys that name a registered component (verl_agent/registry.py); an unknown name's error lists the registered ones.
EngineName = Annotated[str, AfterValidator(ENGINES.check)]
EstimatorName = Annotated[str, AfterValidator(ADV_ESTIMATORS.check)]
PolicyLossName = Annotated[str, AfterValidator(POLICY_LOSSES.check)]
RewardManagerName = Annotated[str, AfterValidator(REWARD_MANAGERS.check)]


# ---------------------------------------------------------------- data
class DataConfig(Section):
    train_files: list[str] = Field(default_factory=list,
                                   description="JSONL/parquet training files, or folders of Harbor task directories")
    val_files: list[str] = Field(default_factory=list,
                                 description="JSONL/parquet validation files, or folders of Harbor task directories")
    train_file: str | None = Field(None, description="single training file (quick-start spelling of train_files)")
    val_file: str | None = Field(None, description="single validation file (quick-start spelling of val_files)")
    train_batch_size: int = Field(8, ge=1, description="prompts per training step")
    val_batch_size: int | None = Field(None, ge=1, description="prompts per validation batch (None: whole set)")
    max_prompt_length: int = Field(512, ge=1, description="prompt token budget (tool schemas included); "
                                   "longer prompts: see filter_overlong_prompts and truncation")
    max_response_length: int = Field(256, ge=1, description="response token budget over all turns")
    reward_fn: str | None = Field(None, description="'module.func' or 'path/file.py:func'")
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    shuffle: bool = True
    seed: int = 0
    skip_bad_rows: bool = Field(False, description="skip malformed rows (counted and reported) instead of failing")
    filter_overlong_prompts: bool = Field(False, description="drop prompts over max_prompt_length before "
                                          "generation (outcome 'filtered', counted as rollout/filtered)")
    return_raw_chat: bool = Field(True, description="verl's key; messages are always kept (false is refused)")
    truncation: Literal["error", "left", "right"] = Field(
        "error", description="prompts over max_prompt_length: error (an infrastructure failure naming the prompt), "
        "or cut the left/right side of the prompt tokens")

    @model_validator(mode="after")
    def _merge_single_files(self) -> DataConfig:
        if self.train_file and self.train_file not in self.train_files:
            self.__dict__["train_files"] = [self.train_file, *self.train_files]
        if self.val_file and self.val_file not in self.val_files:
            self.__dict__["val_files"] = [self.val_file, *self.val_files]
        return self


class CustomRewardFunctionConfig(Section):
    """verl's spelling of the reward function: a file path and a function name."""

    path: str | None = None
    name: str = "compute_score"


class RewardModelModelConfig(Section):
    """reward_model.model: verl's reward model; here the judge model's name."""

    path: str | None = Field(None, description="the judge's model name, sent as `model` in each request (vLLM and "
                             "SGLang serve a model under its path unless --served-model-name says otherwise)")


class JudgeConfig(Section):
    """reward_model.judge: the judge's endpoint, rubric, score format and request settings (verl_agent/judge.py)."""

    api_base: str | None = Field(None, description="the judge's OpenAI-compatible base URL, e.g. "
                                 "http://127.0.0.1:8000/v1 (requests go to <api_base>/chat/completions)")
    api_key_env: str | None = Field("OPENAI_API_KEY", description="the environment variable holding the bearer "
                                    "token, read in each rollout worker (the key itself stays out of the config "
                                    "and the run's saved copy); unset or null: no token")
    scoring_prompt: str = Field(DEFAULT_SCORING_PROMPT, description="the rubric sent as the user message; "
                                "{prompt}, {response}, {ground_truth}, {data_source} are filled in")
    score_pattern: str = Field(DEFAULT_SCORE_PATTERN, description="regex whose last match's first group is the "
                               "score (default: a 'Score: N' line, '**Score:** N' or JSON \"score\": N)")
    score_range: tuple[float, float] = Field((0.0, 10.0), description="[low, high] of the judge's scale; the "
                                             "score is normalised to [0, 1] and one outside it is unparsable")
    max_concurrent: int = Field(32, ge=1, description="judge requests in flight at once (per rollout worker)")
    max_retries: int = Field(3, ge=0, description="retries of a request answered 429 or 5xx, timed out or "
                             "not connected")
    backoff: float = Field(0.5, ge=0, description="seconds before the first retry, doubling (at most 8); a "
                           "Retry-After header wins")
    timeout: float = Field(60.0, gt=0, description="seconds an attempt may wait to connect, send, or for the next "
                           "bytes of the answer before it is retried")
    max_tokens: int = Field(512, ge=1, description="the judge's answer budget")
    temperature: float = Field(0.0, ge=0)
    cache_size: int = Field(100_000, ge=0, description="scores cached per rollout worker, keyed by a hash of the "
                            "model, settings and rendered rubric; 0: no cache")

    @field_validator("scoring_prompt")
    @classmethod
    def _check_prompt(cls, v: str) -> str:
        return check_scoring_prompt(v)

    @field_validator("score_pattern")
    @classmethod
    def _check_pattern(cls, v: str) -> str:
        check_score_pattern(v)
        return v

    @field_validator("score_range")
    @classmethod
    def _check_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not v[0] < v[1]:
            raise ValueError(f"score_range must be [low, high] with low < high, got {list(v)}")
        return v


class RewardModelConfig(Section):
    """verl's reward_model section: with enable=true an LLM judge gives the reward (verl_agent/judge.py)."""

    enable: bool = Field(False, description="score every trajectory with the judge (instead of a reward function)")
    reward_manager: RewardManagerName = Field(
        "naive", description="how a trajectory's reward is computed; naive: the judge, the reward function or "
        "the tools' and interactions' scores, one call per trajectory (verl_agent/registry.py)")
    model: RewardModelModelConfig = Field(default_factory=RewardModelModelConfig)
    judge: JudgeConfig = Field(default_factory=JudgeConfig)


# ---------------------------------------------------------------- model / actor
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


class RefConfig(Section):
    log_prob_micro_batch_size_per_gpu: int | None = Field(None, ge=1, description="as rollout's, for the ref model")
    log_prob_micro_batch_size: int | None = Field(None, description="verl's deprecated global size (refused)")
    fsdp_config: FSDPConfig = Field(default_factory=FSDPConfig)


# ---------------------------------------------------------------- rollout
DEFAULT_SUMMARY_PROMPT = ("Your context is nearly full. Summarize everything you will still need to finish the "
                          "task: what you found, what you did, and what is left to do. Reply with the summary only.")


class ContextConfig(Section):
    """actor_rollout_ref.rollout.multi_turn.context: what the native agent loop does when the history outgrows
    the context (rollout/context.py; docs/training.md#long-horizons-context-management)."""

    strategy: str = Field("none", description="none | drop_observations | truncate_middle | summarize | a user "
                          "function 'pkg.mod:fn' or 'file.py:fn' (OpenAI messages in, messages out)")
    trigger_length: int | None = Field(None, ge=1, description="rewrite the context once it passes this many tokens; "
                                       "None: when the next turn might not fit multi_turn.max_context_length")
    keep_last_turns: int = Field(2, ge=0, description="drop_observations: the observations of this many latest "
                                 "assistant turns stay; older ones become a placeholder")
    keep_last_tokens: int = Field(256, ge=1, description="truncate_middle: tokens of latest messages kept after "
                                  "the system message and the task")
    summary_prompt: str = Field(DEFAULT_SUMMARY_PROMPT, min_length=1,
                                description="summarize: the user message that asks the policy for its summary")
    summary_max_tokens: int = Field(128, ge=1, description="summarize: tokens the summary turn may generate (its own "
                                    "cap: multi_turn.max_tokens_per_turn caps the agent's turns, not this one)")

    @field_validator("strategy", mode="before")
    @classmethod
    def _known_strategy(cls, value: Any) -> Any:
        if value is None:  # `strategy=none` on the command line parses as null
            return "none"
        if not isinstance(value, str):
            return value
        if ":" not in value and "." not in value:  # a name, not a function path
            try:
                CONTEXT_STRATEGIES.check(value)
            except ValueError as e:
                raise ValueError(f"{e}, or name a function as 'pkg.mod:fn' or 'path/file.py:fn'") from None
        return value


class MultiTurnConfig(Section):
    enable: bool = True
    max_assistant_turns: int | None = Field(4, ge=1, description="None: until the response budget")
    max_user_turns: int | None = Field(4, ge=0, description="interaction replies allowed; None: unlimited")
    max_parallel_calls: int = Field(1, ge=1, description="tool calls run per turn; extra calls get an error")
    max_tool_response_length: int = Field(256, ge=1, description="characters kept of one tool response")
    tool_response_truncate_side: Literal["left", "middle", "right"] = "middle"
    tool_config_path: str | None = None
    interaction_config_path: str | None = None
    format: str | None = Field(None, description="tool-call format: one of parsers.FORMATS (hermes, llama3_json, "
                                 "mistral, qwen3_coder, glm45, deepseek, kimi_k2, harmony, llama4_pythonic); None: "
                                 "detect from the chat template")

    @field_validator("format")
    @classmethod
    def _known_format(cls, value: str | None) -> str | None:
        from verl_agent.parsers import FORMATS, parser_key

        if value is not None and parser_key(value) not in FORMATS:
            raise ValueError(f"unknown tool-call format; choose one of {list(FORMATS)} or null (detect)")
        return value
    history: Literal["exact", "template"] = Field(
        "exact", description="exact: append each observation's token-exact ids to the generated ones (on-policy "
        "token for token; needs a prefix-stable template); template: every turn's context is the chat template's "
        "rendering of the whole history, as at deployment (earlier reasoning dropped where the template drops it); "
        "where that rendering does not extend the tokens so far, the turn starts a new segment")
    tool_timeout: float = Field(30.0, gt=0, description="seconds one tool call may take")
    max_tokens_per_turn: int | None = Field(None, ge=1, description="tokens one assistant turn may generate "
                                            "(stop reason max_tokens_per_turn); None: no cap of its own")
    max_total_tokens: int | None = Field(None, ge=1, description="generated + observation tokens over the whole "
                                         "trajectory, all segments (stop reason max_total_tokens); None: no cap")
    max_context_length: int | None = Field(None, ge=2, description="tokens the model sees at once, prompt included "
                                           "(context.strategy rewrites the history to stay under it; stop reason "
                                           "max_context_length); None: no cap of its own")
    context: ContextConfig = Field(default_factory=ContextConfig)

    @model_validator(mode="after")
    def _context_needs_a_limit(self) -> MultiTurnConfig:
        c = self.context
        if c.strategy != "none" and self.max_context_length is None and c.trigger_length is None:
            raise ValueError(f"multi_turn.context.strategy={c.strategy!r} needs multi_turn.max_context_length "
                             "or multi_turn.context.trigger_length (when to rewrite the history)")
        if self.max_context_length is not None and c.trigger_length is not None \
                and c.trigger_length >= self.max_context_length:
            raise ValueError(f"multi_turn.context.trigger_length={c.trigger_length} must be below "
                             f"multi_turn.max_context_length={self.max_context_length}")
        if c.strategy == "summarize":
            self.check_summary_room(0)  # the summary prompt's tokens are counted once a tokenizer is loaded
        return self

    def summary_room(self, request_tokens: int) -> int | None:
        """The fewest tokens the `summarize` turn may generate at a rewrite: max_context_length less the longest
        context before it (the trigger plus one reply of max_tokens_per_turn) and the summary request
        (`request_tokens`: the summary prompt with its template). None where the config bounds no such room
        (no max_context_length, or an explicit trigger without max_tokens_per_turn)."""
        c, limit = self.context, self.max_context_length
        if limit is None:
            return None
        if c.trigger_length is None:  # the agent loop's default trigger leaves the room by construction
            return c.summary_max_tokens
        if self.max_tokens_per_turn is None:
            return None
        return limit - c.trigger_length - self.max_tokens_per_turn - request_tokens

    def check_summary_room(self, request_tokens: int) -> None:
        """Raise when the summary turn could not generate `context.summary_max_tokens` (it would never act, or act
        cut short), naming what to raise or lower."""
        c, room = self.context, self.summary_room(request_tokens)
        if room is None or room >= c.summary_max_tokens:
            return
        need = c.summary_max_tokens - room
        fixes = [f"raise multi_turn.max_context_length to {self.max_context_length + need}"]
        if c.trigger_length - need >= 1:
            fixes.append(f"lower multi_turn.context.trigger_length to {c.trigger_length - need}")
        if room > 0:
            fixes.append(f"lower multi_turn.context.summary_max_tokens to {room}")
        prompt = f" and the summary prompt ({request_tokens} tokens with its template)" if request_tokens else ""
        raise ValueError(
            f"multi_turn.context.strategy='summarize' has room for {max(room, 0)} summary tokens, below "
            f"context.summary_max_tokens={c.summary_max_tokens}: context.trigger_length={c.trigger_length} plus one "
            f"reply of max_tokens_per_turn={self.max_tokens_per_turn}{prompt} fill "
            f"max_context_length={self.max_context_length}; " + " or ".join(fixes))


class ValKwargsConfig(Section):
    n: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    do_sample: bool = False


class SGLangConfig(Section):
    url: str | None = Field(None, description="existing SGLang server (rollout CLI); None: launch one")
    python: str | None = Field(None, description="interpreter of the SGLang environment")
    port: int = Field(30000, description="port of a server the rollout CLI launches (the trainer picks free ports)")
    extra_args: list[str] = Field(default_factory=list, description="appended to `python -m sglang.launch_server`")
    env: dict[str, str] = Field(default_factory=dict, description="extra environment of a launched server")


class AgentFunctionConfig(Section):
    """actor_rollout_ref.rollout.agent: train your own agent function through the OpenAI-compatible endpoint
    (verl_agent/rollout/openai/agent_function.py; docs/openai_agents.md)."""

    entrypoint: str | None = Field(None, description="'module:function' or 'path/file.py:function', an async "
                                   "run_agent(sample, base_url, api_key); None: the native agent loop")
    timeout: float = Field(600.0, gt=0, description="seconds one agent run may take (then an infra failure)")
    model_name: str = Field("policy", description="the model name the endpoint serves (others get 404)")
    host: str = Field("127.0.0.1", description="interface the in-process endpoint listens on (a free port)")
    max_request_bytes: int = Field(4 << 20, ge=1024, description="larger request bodies get HTTP 413")
    max_concurrency: int | None = Field(None, ge=1, description="agent runs at once per worker; None: all")
    use_request_sampling: bool = Field(False, description="apply the agent's temperature/top_p/seed (the trainer's "
                                       "sampling settings otherwise win, so log-probs match the actor)")


_HF = HFEngineSettings()  # the hf engine's defaults, for the keys that configure it


class RolloutConfig(Section):
    name: EngineName = Field(
        "hf", description="a registered engine: hf | sglang | your own (verl_agent/registry.py)")
    mode: Literal["sync", "async"] = Field("async", description="trajectories always run concurrently (sync is refused)")
    n: int = Field(1, ge=1, description="trajectories per prompt (GRPO group size)")
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = -1
    do_sample: bool = True
    max_batch_size: int = Field(_HF.max_num_seqs, ge=1, description="hf engine: KV slots when max_num_seqs "
                                "is unset")
    max_num_seqs: int | None = Field(None, ge=1, description="hf engine: sequences holding a KV slot at once "
                                     "(default: max_batch_size; in the trainer, at least a slot for every "
                                     "trajectory the engine holds at once, the batches fed ahead included)")
    max_num_batched_tokens: int = Field(_HF.max_num_batched_tokens, ge=1, description="hf engine: prompt tokens "
                                        "per prefill chunk")
    max_model_len: int | None = Field(_HF.max_model_len, ge=2, description="hf engine: tokens one KV slot holds "
                                      "(default: data.max_prompt_length + data.max_response_length, more where "
                                      "segments restart from a rewritten history; at most the model's limit)")
    prompt_length: int | None = Field(None, description="verl's copy of data.max_prompt_length (must match)")
    response_length: int | None = Field(None, description="verl's copy of data.max_response_length (must match)")
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    log_prob_micro_batch_size_per_gpu: int | None = Field(
        None, ge=1, description="sequences per log-prob micro-batch when actor.use_dynamic_bsz=false "
        "(default: actor.ppo_micro_batch_size_per_gpu)")
    log_prob_micro_batch_size: int | None = Field(None, description="verl's deprecated global size (refused)")
    tensor_model_parallel_size: int = Field(1, description="one engine replica per worker (values > 1 refused)")
    gpu_memory_utilization: float = Field(_HF.gpu_memory_utilization, gt=0, le=1, description="share of device memory (host RAM on CPU, "
                                          "split between the trainer's ranks on a host) for weights + KV cache: hf "
                                          "engine sizes its KV slots by it, at most what is available; in the "
                                          "trainer on CPU also at most what the update leaves; sglang's "
                                          "--mem-fraction-static")
    enable_torch_compile: bool = Field(_HF.torch_compile, description="torch.compile the decode step: hf compiles "
                                       "its forward before the CUDA-graph capture (a compile at each new decode "
                                       "shape delays the first steps); sglang: --enable-torch-compile")
    free_cache_engine: bool = Field(True, description="sleep the engine (free its caches/device memory) while "
                                    "the actor trains; trainer.mode=sync only (the async modes keep generating)")
    lora_mode: Literal["auto", "merge", "unmerged"] = Field(
        "auto", description="hf engine, with LoRA: merge the synced adapters into its weights (a copy of each "
        "targeted base weight is kept; the faster decode on CPU) or compute them unmerged in every forward (no "
        "copy: the memory matters on a GPU). auto: merge on CPU, unmerged on GPU")
    multi_turn: MultiTurnConfig = Field(default_factory=MultiTurnConfig)
    val_kwargs: ValKwargsConfig = Field(default_factory=ValKwargsConfig)
    sglang: SGLangConfig = Field(default_factory=SGLangConfig)
    agent: AgentFunctionConfig = Field(default_factory=AgentFunctionConfig)

    def engine_lora_mode(self, device_type: str) -> str:
        """lora_mode with auto resolved for an engine on `device_type` ("cpu", "cuda")."""
        if self.lora_mode != "auto":
            return self.lora_mode
        return "merge" if device_type == "cpu" else "unmerged"


class ActorRolloutRefConfig(Section):
    hybrid_engine: bool = True
    model: ModelConfig = Field(default_factory=ModelConfig)
    actor: ActorConfig = Field(default_factory=ActorConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    ref: RefConfig = Field(default_factory=RefConfig)


# ---------------------------------------------------------------- critic / algorithm / trainer
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


class TrainerConfig(Section):
    project_name: str = "verl_agent"
    experiment_name: str = "run"
    total_epochs: int = Field(1, ge=1)
    total_training_steps: int | None = Field(None, ge=1, description="overrides total_epochs when set")
    logger: list[str] = Field(default_factory=lambda: ["console", "tensorboard"],
                              description="console|tensorboard|wandb|mlflow (wandb, mlflow: optional extras)")
    default_local_dir: str = Field("runs/${trainer.project_name}/${trainer.experiment_name}")
    save_freq: int = Field(-1, description="checkpoint every N steps; -1: only at the end")
    checkpoint_compression: Literal["auto", "none", "zstd"] = Field(
        "auto", description="zstd: store each tensor's most significant bytes (float sign + exponent) zstd-"
        "compressed, the rest as is: bf16 weights and AdamW moments shrink, so saves that wait on the disk get "
        "faster at a CPU cost per byte. auto: zstd where a worker may use 8+ cores and zstandard is installed, "
        "else none")
    test_freq: int = Field(-1, description="validate every N steps; -1: only before/after")
    val_before_train: bool = True
    resume_mode: Literal["auto", "disable", "resume_path"] = "auto"
    resume_from_path: str | None = None
    n_gpus_per_node: int = Field(0, ge=0, description="0: CPU workers (see num_cpu_workers)")
    nnodes: int = Field(1, ge=1)
    num_cpu_workers: int = Field(2, ge=1, description="FSDP workers when n_gpus_per_node == 0")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    ray_address: str | None = Field(None, description="None: $RAY_ADDRESS if set, else start a fresh local Ray; 'auto': join a running cluster")
    seed: int = 0
    log_trajectories: bool = Field(True, description="write every step's trajectories to "
                                   "<run dir>/trajectories/step_N.jsonl (verl-agent view reads them)")
    mode: Literal["sync", "one_step_off", "async"] = Field(
        "sync", description="sync: roll out a batch, then train on it. one_step_off: batch k+1 rolls out while "
        "batch k trains (weights reach the engine once both are done). async: rollouts run continuously; each "
        "step takes the first groups to finish, at most max_staleness policy versions old")
    max_staleness: int = Field(1, ge=0, description="async: batches fed ahead of training = the largest policy-"
                               "version lag allowed; older groups are dropped (counted) and rolled out again")
    partial_rollout: bool = Field(True, description="async: on a weight update, trajectories pause at a token "
                                  "boundary (hf continuous scheduler, sglang; a turn boundary on engines without "
                                  "Engine.interrupt) and continue "
                                  "under the new weights (each token records its version); false: started "
                                  "trajectories finish under the old weights first")
    placement: Literal["colocated", "split"] = Field(
        "colocated", description="colocated: every train worker holds an engine replica on its own device (it "
        "sleeps during updates). split: trainer.rollout_workers separate Ray actors run the engines (their own "
        "processes and placement group) and train rank 0 streams them the weights after each update")
    rollout_workers: int = Field(1, ge=1, description="split: engine replicas (Ray actors); each batch is "
                                 "sharded over them, their groups are spread over the train ranks")
    rollout_gpus_per_worker: float = Field(1.0, gt=0, description="split, on GPU: GPUs per rollout worker; a "
                                           "fraction below 1 shares a GPU with a train worker, which then takes "
                                           "the rest of it (Ray fractional GPUs)")
    weight_transport: Literal["auto", "collective", "object_store"] = Field(
        "auto", description="split: how train rank 0 sends the weights. auto: by handle to every rollout worker "
        "that can map its memory (same host; on GPU the same card: CUDA IPC; on CPU shared memory in /dev/shm "
        "while it has room), by broadcast in a process group of their own (NCCL between GPUs, gloo on CPU) to "
        "the others. collective: the broadcast to every worker. object_store: Ray's object store for all")
    max_infra_failure_fraction: float = Field(
        0.2, ge=0, le=1, description="stop the run when more than this share of a step's trajectories failed "
        "for infrastructure reasons (engine, sandbox, tool crash, reward fn, interaction)")
    critic_warmup: int = 0
    export_merged_model: bool = Field(False, description="with LoRA: besides the adapter folder <run dir>/hf_model, "
                                      "write the base with the adapters merged in to <run dir>/hf_model_merged")
    profile_steps: list[Annotated[int, Field(ge=1)]] | None = Field(None, description="steps to profile with torch.profiler (rollout "
                                            "to weight sync): each train rank writes <run dir>/profile/"
                                            "step_N_rankR.txt (top ops) and .json.gz (Chrome trace)")

    @property
    def batches_ahead(self) -> int:
        """Batches fed ahead of the one in training: 0 sync, 1 one_step_off, max_staleness async."""
        return {"sync": 0, "one_step_off": 1, "async": self.max_staleness}[self.mode]

    @model_validator(mode="before")
    @classmethod
    def _logger_as_list(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("logger"), str):
            data = {**data, "logger": [data["logger"]]}
        return data


class RunConfig(Section):
    plugins: list[str] = Field(default_factory=list, description="your modules, imported before the rest of the "
                               "config is checked (in the driver and every worker): 'pkg.mod' or 'path/file.py' "
                               "(relative to the working directory); they register estimators, losses, engines, "
                               "... by name (verl_agent/registry.py)")
    data: DataConfig = Field(default_factory=DataConfig)
    actor_rollout_ref: ActorRolloutRefConfig = Field(default_factory=ActorRolloutRefConfig)
    critic: CriticConfig = Field(default_factory=CriticConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    custom_reward_function: CustomRewardFunctionConfig = Field(default_factory=CustomRewardFunctionConfig)
    reward_model: RewardModelConfig = Field(default_factory=RewardModelConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.trainer.default_local_dir)

    @property
    def world_size(self) -> int:
        t = self.trainer
        return t.n_gpus_per_node * t.nnodes if t.n_gpus_per_node > 0 else t.num_cpu_workers

    @property
    def slot_tokens(self) -> int:
        """Tokens one hf engine KV slot holds: rollout.max_model_len, else the longest stretch of one trajectory
        the budgets let the engine see at once (verl's default, prompt + response, where nothing rewrites the
        history; a segment that starts from a rewritten history (a context strategy, or an agent function's
        history rewrite) may have a prompt up to that long plus a response budget of its own)."""
        r = self.actor_rollout_ref.rollout
        if r.max_model_len is not None:
            return r.max_model_len
        mt, budget = r.multi_turn, self.data.max_prompt_length + self.data.max_response_length
        longest = max(budget, mt.max_context_length or 0)
        if mt.context.strategy != "none" or r.agent.entrypoint is not None:
            longest = max(longest, (mt.max_context_length or budget) + self.data.max_response_length)
        return longest

    @model_validator(mode="before")
    @classmethod
    def _import_plugins(cls, data: Any) -> Any:
        """Import `plugins` first: the names they register must be known when the sections are checked."""
        if isinstance(data, dict) and data.get("plugins"):
            data = {**data, "plugins": import_plugins(data["plugins"])}
        return data

    @model_validator(mode="after")
    def _refuse_unimplemented(self) -> RunConfig:
        problems = [f"{key}={value!r}: {hint}" for key, value, hint in _unimplemented(self)]
        if problems:
            raise ValueError("not implemented here:\n  " + "\n  ".join(problems))
        return self


_Refuse = Callable[[bool, str, Any, str], None]  # refuse(when, key, value, what to use instead)


def import_plugins(specs: Any) -> list[str]:
    """Import each of `plugins` ('pkg.mod' or 'path/file.py'); returns them with file paths made absolute, so that
    Ray workers (another working directory) import the same files."""
    if not isinstance(specs, list) or not all(isinstance(s, str) and s for s in specs):
        raise ValueError(f"plugins must be a list of module paths ('pkg.mod' or 'path/file.py'), got {specs!r}")
    out = []
    for i, spec in enumerate(specs):
        spec = str(Path(spec).resolve()) if spec.endswith(".py") else spec
        try:
            import_module(spec)
        except ImportError as e:
            raise ValueError(f"plugins[{i}]={spec!r}: {e}") from None
        out.append(spec)
    return out


def _unimplemented(c: RunConfig) -> list[tuple[str, Any, str]]:
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


# ---------------------------------------------------------------- loading
_FLOAT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")


def parse_value(text: str) -> Any:
    """An override's value: int, float (also 1e-6), bool, null, list, mapping or string (quotes optional)."""
    if _FLOAT.match(text) and not re.match(r"^[+-]?\d+$", text):
        return float(text)
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if value is None and text.strip().lower() not in ("null", "none", "~", ""):
        return text
    if isinstance(value, str) and text.strip().lower() == "none":
        return None
    return value


def parse_override(item: str) -> tuple[list[str], Any]:
    """'a.b.c=value' -> (['a', 'b', 'c'], value). Hydra's '+a.b=v' spelling is accepted."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not of the form key=value (e.g. data.train_batch_size=8)")
    key, _, raw = item.partition("=")
    key = key.strip().lstrip("+")
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {item!r} has an empty key part")
    return key.split("."), parse_value(raw.strip())


def all_keys(model: type[BaseModel] = RunConfig, prefix: str = "") -> list[str]:
    """Every valid dotted key of the schema (used for 'did you mean' and `verl-agent config keys`)."""
    out = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        out.append(key)
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out.extend(all_keys(ann, key + "."))
    return out


def _set(tree: dict, path: list[str], value: Any, where: str) -> None:
    node = tree
    for i, part in enumerate(path[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{where}: {'.'.join(path[: i + 1])} is a value, not a section")
        node = child
    node[path[-1]] = value


# keys with no meaning here that a config may still carry: what to do instead of a "did you mean"
_NO_SUCH_SETTING = {
    "actor_rollout_ref.rollout.scheduler": "the hf engine has one scheduler (continuous batching); delete the "
    "key (actor_rollout_ref.rollout.max_num_seqs=1 runs one request at a time)",
}


def _format_errors(err: ValidationError, tree: dict) -> str:
    keys = all_keys()
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"] if not isinstance(p, int) or True)
        if e["type"] == "extra_forbidden" and loc in _NO_SUCH_SETTING:
            lines.append(f"unknown key {loc!r}: {_NO_SUCH_SETTING[loc]}")
        elif e["type"] == "extra_forbidden":
            close = difflib.get_close_matches(loc, keys, n=1, cutoff=0.5)
            if not close:  # try matching the last part within the same section
                section = loc.rsplit(".", 1)[0] + "." if "." in loc else ""
                names = [k for k in keys if k.startswith(section)]
                close = difflib.get_close_matches(loc, names, n=1, cutoff=0.0)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            lines.append(f"unknown key {loc!r}{hint}")
        elif not loc:  # a whole-config rule (_refuse_unimplemented): its message names the keys
            lines.append(str(e["msg"]).removeprefix("Value error, "))
        else:
            value = e.get("input")
            lines.append(f"{loc}={value!r}: {e['msg']}")
    return "invalid config:\n  " + "\n  ".join(lines)


_REF = re.compile(r"\$\{([\w.]+)\}")


def _with_defaults(tree: Any, defaults: Any) -> Any:
    if not (isinstance(tree, dict) and isinstance(defaults, dict)):
        return tree
    return {**defaults, **{k: _with_defaults(v, defaults.get(k)) for k, v in tree.items()}}


def _interpolate(root: dict) -> dict:
    """Resolve '${a.b}' references (whole dotted keys, like OmegaConf) anywhere in the tree, lists too.

    A value that is nothing but a reference takes the referenced value with its type (verl's YAML writes
    `prompt_length: ${data.max_prompt_length}`); a reference inside text becomes text; a referenced
    value's own references are resolved.
    """

    def lookup(name: str, chain: tuple[str, ...]) -> Any:
        if name in chain:
            raise ConfigError(f"interpolation ${{{name}}} refers to itself: {' -> '.join((*chain, name))}")
        node: Any = root
        for part in name.split("."):
            if not isinstance(node, dict) or part not in node:
                raise ConfigError(f"interpolation ${{{name}}} names no key")
            node = node[part]
        return resolve(node, (*chain, name))

    def resolve(value: Any, chain: tuple[str, ...] = ()) -> Any:
        if isinstance(value, dict):
            return {k: resolve(v, chain) for k, v in value.items()}
        if isinstance(value, list):
            return [resolve(v, chain) for v in value]
        if not isinstance(value, str) or "${" not in value:
            return value
        if whole := _REF.fullmatch(value):
            return lookup(whole.group(1), chain)
        return _REF.sub(lambda m: str(lookup(m.group(1), chain)), value)

    return resolve(root)


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """YAML file (optional) + dotted overrides -> validated RunConfig. Raises ConfigError."""
    tree: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            tree = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections (data:, trainer:, ...)")
    for item in overrides:
        keys, value = parse_override(item)
        _set(tree, keys, value, f"override {item!r}")
    tree = _interpolate(_with_defaults(tree, RunConfig().model_dump()))  # defaults can be referenced
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, tree)) from None


def save_config(cfg: RunConfig, path: str | Path) -> Path:
    """Write the resolved config (what actually ran) as YAML."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg.model_dump(), sort_keys=False))
    return path
