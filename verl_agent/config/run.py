"""`RunConfig`: the whole tree, one section per component, and `plugins`, imported before the sections are
checked. Its last check is `refusals.unimplemented`: every value whose machinery does not exist here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from verl_agent.config.actor import ActorConfig, CriticConfig, ModelConfig, RefConfig
from verl_agent.config.algorithm import AlgorithmConfig
from verl_agent.config.base import Section
from verl_agent.config.data import DataConfig
from verl_agent.config.refusals import unimplemented
from verl_agent.config.reward import CustomRewardFunctionConfig, RewardModelConfig
from verl_agent.config.rollout import RolloutConfig
from verl_agent.config.trainer import TrainerConfig
from verl_agent.imports import import_module

__all__ = ["ActorRolloutRefConfig", "RunConfig", "import_plugins"]


class ActorRolloutRefConfig(Section):
    hybrid_engine: bool = True
    model: ModelConfig = Field(default_factory=ModelConfig)
    actor: ActorConfig = Field(default_factory=ActorConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    ref: RefConfig = Field(default_factory=RefConfig)


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
        problems = [f"{key}={value!r}: {hint}" for key, value, hint in unimplemented(self)]
        if problems:
            raise ValueError("not implemented here:\n  " + "\n  ".join(problems))
        return self


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
