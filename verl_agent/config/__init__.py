"""The run configuration: a typed tree with verl's key names, loaded from YAML plus `a.b.c=value` overrides.

    cfg = load_config("examples/calculator/config.yaml", ["data.train_batch_size=8", "trainer.logger=[console]"])

Every section is a small pydantic model that forbids unknown keys, so a typo fails fast with the closest
valid key named (`ConfigError`). Keys follow verl wherever the concept is the same, so a verl user's
command line (`actor_rollout_ref.actor.optim.lr=1e-6 algorithm.adv_estimator=grpo ...`) reads as-is.
Every key works or is refused: verl keys whose machinery does not exist here (e.g. `rollout.mode=sync`,
`tensor_model_parallel_size=2`, HSDP via `fsdp_size`) parse at their default values, and a non-default
value is a `ConfigError` naming the key and what to use instead (`refusals.py`).

One module per component, each holding that component's keys: `data`, `actor` (model, actor, ref, critic),
`rollout` (engine, sampling, multi-turn, context, agent function), `algorithm`, `trainer`, `reward` (reward
function, judge); `run` puts them together as `RunConfig`, `refusals` holds the rules across sections, and
`loading` reads YAML and overrides. Import everything from `verl_agent.config`.
"""

from __future__ import annotations

from verl_agent.config.actor import (
    ActorConfig,
    CriticConfig,
    CriticModelConfig,
    FSDPConfig,
    ModelConfig,
    OptimConfig,
    PolicyLossConfig,
    RefConfig,
)
from verl_agent.config.algorithm import (
    AlgorithmConfig,
    FilterGroupsConfig,
    GiGPOConfig,
    KLCtrlConfig,
    RolloutCorrectionConfig,
)
from verl_agent.config.base import ConfigError, Section
from verl_agent.config.data import DataConfig
from verl_agent.config.loading import all_keys, load_config, parse_override, parse_value, save_config
from verl_agent.config.reward import (
    CustomRewardFunctionConfig,
    JudgeConfig,
    RewardModelConfig,
    RewardModelModelConfig,
)
from verl_agent.config.rollout import (
    DEFAULT_SUMMARY_PROMPT,
    AgentFunctionConfig,
    ContextConfig,
    MultiTurnConfig,
    RolloutConfig,
    SGLangConfig,
    ValKwargsConfig,
)
from verl_agent.config.run import ActorRolloutRefConfig, RunConfig, import_plugins
from verl_agent.config.trainer import TrainerConfig

__all__ = [
    # loading
    "ConfigError", "RunConfig", "load_config", "parse_override", "parse_value", "save_config", "all_keys",
    "import_plugins",
    # the sections, for type hints and for building a config in code
    "Section", "DataConfig", "ActorRolloutRefConfig", "ModelConfig", "ActorConfig", "OptimConfig", "PolicyLossConfig",
    "FSDPConfig", "RefConfig", "RolloutConfig", "MultiTurnConfig", "ContextConfig", "DEFAULT_SUMMARY_PROMPT",
    "ValKwargsConfig", "SGLangConfig", "AgentFunctionConfig", "CriticConfig", "CriticModelConfig", "AlgorithmConfig",
    "KLCtrlConfig", "FilterGroupsConfig", "RolloutCorrectionConfig", "GiGPOConfig", "TrainerConfig",
    "CustomRewardFunctionConfig", "RewardModelConfig", "RewardModelModelConfig", "JudgeConfig",
]
