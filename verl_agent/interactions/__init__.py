"""Interactions: BaseInteraction (verl API + Gymnasium face), YAML registry, built-in environments."""

from verl_agent.interactions.base import BaseInteraction, InteractionSession, last_assistant_text
from verl_agent.interactions.checker import check_interaction, check_interaction_async
from verl_agent.interactions.errors import InteractionConfigError, InteractionContractError, InteractionError
from verl_agent.interactions.guess_number import GuessNumberEnv
from verl_agent.interactions.gym import GymInteraction
from verl_agent.interactions.math_feedback import MathFeedbackInteraction
from verl_agent.interactions.registry import build_interactions, load_interactions, select_interaction

__all__ = [
    "BaseInteraction",
    "GuessNumberEnv",
    "GymInteraction",
    "InteractionConfigError",
    "InteractionContractError",
    "InteractionError",
    "InteractionSession",
    "MathFeedbackInteraction",
    "build_interactions",
    "check_interaction",
    "check_interaction_async",
    "last_assistant_text",
    "load_interactions",
    "select_interaction",
]
