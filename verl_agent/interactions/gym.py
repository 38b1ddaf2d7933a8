"""The Gymnasium face of interactions: write `reset`/`step`, get a BaseInteraction.

Write an environment the Gymnasium way, with text observations and actions:

    reset(seed=None, options=None) -> (observation: str, info: dict)
    step(action: str) -> (observation: str, reward: float, terminated: bool, truncated: bool, info: dict)

and wrap it with `GymInteraction`, in code (`GymInteraction({"name": "game"}, env_fn=MyEnv)`)
or in the interaction YAML (`class_name` naming a `gymnasium.Env` subclass, or
`GymInteraction` with `config: {env_id: "verl_agent/GuessNumber-v0"}`).

How the adapter maps the two APIs, per trajectory (instance id):
- start_interaction: a new env from `env_fn`, `reset(seed=kwargs.pop("seed"), options=rest of interaction_kwargs)`;
  the reset observation is served by `initial_observation`.
- generate_response: `step(content of the last assistant message)`;
  done = terminated or truncated; text = the observation; turn score = the reward.
- calculate_score: sum of rewards (config `score: sum`, default) or the last reward (`score: last`).
- finalize_interaction: `env.close()` and the state is dropped.
`terminated` vs `truncated` keep Gymnasium's meaning and are reported in `info`.
Envs run their `step` inline: keep it fast or make the env itself async-friendly.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from verl_agent.imports import import_object
from verl_agent.interactions.base import BaseInteraction, last_assistant_text
from verl_agent.interactions.errors import InteractionConfigError

__all__ = ["GymInteraction"]

_SCORE_MODES = ("sum", "last")


def _env_factory(config: dict[str, Any]) -> Callable[[], Any]:
    """env_fn from config: `env_id` (a Gymnasium id) or `env` (dotted path to a class), plus `env_kwargs`."""
    kwargs = dict(config.get("env_kwargs") or {})
    if config.get("env_id"):
        import gymnasium

        env_id = config["env_id"]
        try:
            gymnasium.spec(env_id)
        except gymnasium.error.Error as e:
            raise InteractionConfigError(f"GymInteraction: unknown Gymnasium env_id {env_id!r}: {e}") from e
        return lambda: gymnasium.make(env_id, **kwargs)
    if config.get("env"):
        try:
            cls = import_object(config["env"])
        except (ImportError, AttributeError) as e:
            raise InteractionConfigError(f"GymInteraction: cannot import env {config['env']!r}: {e}") from e
        return lambda: cls(**kwargs)
    raise InteractionConfigError("GymInteraction needs `env_fn`, or config `env_id` or `env` (a dotted class path)")


class GymInteraction(BaseInteraction):
    """Adapter: any env with text `reset`/`step` (e.g. a gymnasium.Env) as a BaseInteraction."""

    def __init__(self, config: dict[str, Any] | None = None, env_fn: Callable[[], Any] | None = None):
        super().__init__(config)
        self.env_fn = env_fn or _env_factory(self.config)
        self.score_mode = self.config.get("score", "sum")
        if self.score_mode not in _SCORE_MODES:
            raise InteractionConfigError(f"{self.name}: config 'score' must be one of {_SCORE_MODES}")

    def make_env(self) -> Any:
        return self.env_fn()

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        instance_id = instance_id or str(uuid.uuid4())
        seed = kwargs.pop("seed", None)
        env = self.make_env()
        obs, info = env.reset(seed=seed, options=kwargs or None)
        self.instances[instance_id] = {"env": env, "obs": str(obs), "rewards": [], "done": False, "info": info}
        return instance_id

    async def initial_observation(self, instance_id: str) -> str | None:
        return self.instances[instance_id]["obs"]

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]:
        state = self.instances[instance_id]
        if state["done"]:  # Gymnasium forbids step after the end; answer "done" again instead
            return True, "", 0.0, {"terminated": True, "truncated": False, "after_done": True}
        obs, reward, terminated, truncated, info = state["env"].step(last_assistant_text(messages))
        state["rewards"].append(float(reward))
        state["done"] = bool(terminated or truncated)
        info = {**dict(info or {}), "terminated": bool(terminated), "truncated": bool(truncated)}
        return state["done"], str(obs), float(reward), info

    async def calculate_score(self, instance_id: str, **kwargs: Any) -> float:
        rewards = self.instances[instance_id]["rewards"]
        if not rewards:
            return 0.0
        return float(sum(rewards)) if self.score_mode == "sum" else rewards[-1]

    async def finalize_interaction(self, instance_id: str, **kwargs: Any) -> None:
        state = self.instances.pop(instance_id, None)
        if state is not None and hasattr(state["env"], "close"):
            state["env"].close()
