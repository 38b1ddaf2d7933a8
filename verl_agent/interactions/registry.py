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
from verl_agent.tools.registry import import_object, read_yaml_list
from verl_agent.verl_compat import VerlNotSupported, resolve_verl_class

__all__ = ["build_interactions", "load_interactions", "select_interaction"]

_ENTRY_KEYS = {"name", "class_name", "config"}
_VERL_METHODS = ("start_interaction", "generate_response", "calculate_score", "finalize_interaction")


def _default_name(class_name: str) -> str:
    """verl's rule: the class name without "Interaction", lower-cased (Gsm8kInteraction -> gsm8k)."""
    return class_name.rsplit(".", 1)[-1].rsplit(":", 1)[-1].replace("Interaction", "").lower()


def _instantiate(obj: Any, config: dict[str, Any], where: str) -> Any:
    if not inspect.isclass(obj):
        raise InteractionConfigError(f"{where}: {obj!r} is not a class")
    if issubclass(obj, BaseInteraction) or all(callable(getattr(obj, m, None)) for m in _VERL_METHODS):
        return obj(config)
    if callable(getattr(obj, "reset", None)) and callable(getattr(obj, "step", None)):
        env_kwargs = dict(config.get("env_kwargs") or {})
        return GymInteraction(config, env_fn=lambda: obj(**env_kwargs))
    raise InteractionConfigError(f"{where}: {obj.__name__} is neither a BaseInteraction nor an env with reset/step")


def _build_one(entry: Any, where: str, base_dir: Path | None) -> Any:
    if not isinstance(entry, Mapping):
        raise InteractionConfigError(f"{where}: expected a mapping with 'class_name', got {type(entry).__name__}")
    unknown = set(entry) - _ENTRY_KEYS
    if unknown:
        raise InteractionConfigError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(_ENTRY_KEYS)}")
    class_name = entry.get("class_name")
    if not isinstance(class_name, str) or not class_name:
        raise InteractionConfigError(f"{where}: 'class_name' is required (a dotted import path)")
    where = f"{where} ({class_name})"
    config = entry.get("config") or {}
    if not isinstance(config, Mapping):
        raise InteractionConfigError(f"{where}: 'config' must be a mapping, got {type(config).__name__}")
    name = entry.get("name") or config.get("name") or _default_name(class_name)
    try:
        obj = import_object(resolve_verl_class(class_name, "interaction"), base_dir)
    except VerlNotSupported as e:
        raise InteractionConfigError(f"{where}: {e}") from None
    except (ImportError, AttributeError) as e:
        raise InteractionConfigError(f"{where}: cannot import {class_name!r}: {e}") from e
    try:
        inter = _instantiate(obj, {**config, "name": name}, where)
    except InteractionConfigError:
        raise
    except Exception as e:  # the interaction's own constructor refused its config
        raise InteractionConfigError(f"{where}: cannot build the interaction: {type(e).__name__}: {e}") from e
    inter.name = name
    return inter


def build_interactions(entries: Any, source: str = "<interactions>", base_dir: Path | None = None) -> dict[str, Any]:
    """Build interactions from a list of verl-style entries; `source` names the file in errors."""
    if not isinstance(entries, list):
        raise InteractionConfigError(f"{source}: 'interaction' must be a list, got {type(entries).__name__}")
    out: dict[str, Any] = {}
    for i, entry in enumerate(entries):
        where = f"{source}: interaction[{i}]"
        inter = _build_one(entry, where, base_dir)
        if inter.name in out:
            raise InteractionConfigError(f"{where}: duplicate interaction name {inter.name!r}")
        out[inter.name] = inter
    return out


def load_interactions(yaml_path: str | Path | None) -> dict[str, Any]:
    """Load a verl interaction YAML (`interaction: [{name, class_name, config}]`); None gives none."""
    if not yaml_path:
        return {}
    path = Path(yaml_path)
    return build_interactions(read_yaml_list(path, "interaction", InteractionConfigError), str(path), path.parent)


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
