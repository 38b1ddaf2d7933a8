"""Interaction registry from YAML in verl's format; the dataset row picks one by name.

    interaction:
      - name: math_feedback
        class_name: verl_agent.interactions.math_feedback.MathFeedbackInteraction
        config: {max_turns: 3}
      - name: guess_number
        class_name: verl_agent.interactions.guess_number.GuessNumberEnv   # a gymnasium.Env: wrapped
        config: {env_kwargs: {high: 50}}

A row's `interaction_kwargs.name` selects the interaction (`select_interaction`).
`class_name` may name a BaseInteraction subclass, a verl interaction class (same
async methods), a `gymnasium.Env` subclass or any class with text `reset`/`step`
(wrapped in GymInteraction), or a "file.py:Name" relative to the YAML. verl's built-in
``verl.interactions.gsm8k_interaction.Gsm8kInteraction`` loads unchanged (verl_agent.verl_compat
maps it to ours); verl classes we have no equivalent for are refused with "not supported yet".
Load errors name the file and the entry.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from verl_agent.interactions.base import BaseInteraction
from verl_agent.interactions.errors import InteractionConfigError
from verl_agent.interactions.gym import GymInteraction
from verl_agent.yaml_registry import Entry, YamlRegistry

__all__ = ["build_interactions", "load_interactions", "select_interaction"]

_VERL_METHODS = ("start_interaction", "generate_response", "calculate_score", "finalize_interaction")


def _default_name(class_name: str) -> str:
    """verl's rule: the class name without "Interaction", lower-cased (Gsm8kInteraction -> gsm8k)."""
    return class_name.rsplit(".", 1)[-1].rsplit(":", 1)[-1].replace("Interaction", "").lower()


def _make_interaction(obj: Any, entry: Entry) -> Any:
    name = entry.fields.get("name") or entry.config.get("name") or _default_name(entry.class_name)
    config = {**entry.config, "name": name}
    if not inspect.isclass(obj):
        raise InteractionConfigError(f"{obj!r} is not a class")
    if issubclass(obj, BaseInteraction) or all(callable(getattr(obj, m, None)) for m in _VERL_METHODS):
        inter = obj(config)
    elif callable(getattr(obj, "reset", None)) and callable(getattr(obj, "step", None)):
        env_kwargs = dict(config.get("env_kwargs") or {})
        inter = GymInteraction(config, env_fn=lambda: obj(**env_kwargs))
    else:
        raise InteractionConfigError(f"{obj.__name__} is neither a BaseInteraction nor an env with reset/step")
    inter.name = name
    return inter


_INTERACTIONS: YamlRegistry[Any] = YamlRegistry(
    section="interaction", kind="interaction", keys=frozenset({"name", "class_name", "config"}),
    error=InteractionConfigError, make=_make_interaction,
)


def build_interactions(entries: Any, source: str = "<interactions>", base_dir: Path | None = None) -> dict[str, Any]:
    """Build interactions from a list of verl-style entries; `source` names the file in errors."""
    return _INTERACTIONS.build(entries, source, base_dir)


def load_interactions(yaml_path: str | Path | None) -> dict[str, Any]:
    """Load a verl interaction YAML (`interaction: [{name, class_name, config}]`); None gives none."""
    return _INTERACTIONS.load(yaml_path)


def select_interaction(interactions: Mapping[str, Any], interaction_kwargs: Mapping[str, Any] | None) -> Any:
    """The interaction named by `interaction_kwargs["name"]`; the only one if unnamed; None if none apply.

    Raises InteractionConfigError for a name that is not registered (names the known ones).
    """
    kwargs = interaction_kwargs or {}
    name = kwargs.get("name")
    if name is None:
        if not kwargs or not interactions:
            return None
        if len(interactions) == 1:
            return next(iter(interactions.values()))
        raise InteractionConfigError(f"interaction_kwargs has no 'name'; choose one of {sorted(interactions)}")
    if name not in interactions:
        raise InteractionConfigError(
            f"interaction_kwargs.name {name!r} is not registered; known: {sorted(interactions)}"
        )
    return interactions[name]
