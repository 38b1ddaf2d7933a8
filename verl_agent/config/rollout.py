"""actor_rollout_ref.rollout: the engine, sampling, the multi-turn agent loop and its context strategy, and
the agent-function endpoint (read by `verl_agent.rollout`, which builds the engine from it)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from verl_agent.config.base import Section
from verl_agent.engine.settings import HFEngineSettings
from verl_agent.registry import CONTEXT_STRATEGIES, ENGINES

__all__ = ["DEFAULT_SUMMARY_PROMPT", "AgentFunctionConfig", "ContextConfig", "MultiTurnConfig", "RolloutConfig",
           "SGLangConfig", "ValKwargsConfig"]

# a registered engine's name (verl_agent/registry.py); an unknown name's error lists the registered ones
EngineName = Annotated[str, AfterValidator(ENGINES.check)]


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
    enable_torch_compile: bool | None = Field(_HF.torch_compile, description="torch.compile the decode step: hf "
                                              "compiles it before the CUDA-graph capture (a compile at each new "
                                              "decode shape delays the first steps; kept on disk for later runs). "
                                              "null: hf compiles on GPU where its own decode step runs (Llama, "
                                              "Mistral, Qwen2, Qwen3), sglang does not; true: always (hf: also "
                                              "transformers' whole forward for other models; sglang: "
                                              "--enable-torch-compile)")
    enable_prefix_caching: bool = Field(_HF.share_prompts, description="hf: a request whose prompt is that of a "
                                        "running request (the samples of a group) copies that one's prompt K/V "
                                        "instead of prefilling it; sglang: false passes --disable-radix-cache")
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
