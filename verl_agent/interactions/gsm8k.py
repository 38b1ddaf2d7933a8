"""GSM8K feedback: "correct" ends the episode, otherwise the user asks the model to reflect (verl's Gsm8kInteraction).

Loaded by verl's class path ``verl.interactions.gsm8k_interaction.Gsm8kInteraction``
(verl_agent.verl_compat) or by ``verl_agent.interactions.gsm8k.Gsm8kInteraction``; the default
name is ``gsm8k``. verl's example gives ``config: {}`` and this class, like verl's, reads no config
key: the number of attempts is bounded by ``multi_turn.max_user_turns`` / ``max_assistant_turns``.

Dataset row: ``extra_info.interaction_kwargs: {name: gsm8k, query: ..., ground_truth: "72"}``.
Each reply is scored with verl's strict GSM8K rule (the last ``#### <number>``, verl_agent.gsm8k);
1.0 ends the episode with "Your response is correct!", anything else asks to try again. The
trajectory's reward is the score of the last reply. For multi-answer math with tolerance and a
turn penalty see MathFeedbackInteraction.
"""

from __future__ import annotations

import uuid
from typing import Any

from verl_agent.gsm8k import gsm8k_score
from verl_agent.interactions.base import BaseInteraction, last_assistant_text

__all__ = ["Gsm8kInteraction"]

CORRECT = "Your response is correct!"
INCORRECT = "Your response is incorrect! You need to reflect on your answer and try again."


class Gsm8kInteraction(BaseInteraction):
    """One state per trajectory: the ground truth and the model's last reply."""

    async def start_interaction(self, instance_id: str | None = None, ground_truth: Any = None, **kwargs: Any) -> str:
        if ground_truth is None:
            raise ValueError(f"{self.name}: interaction_kwargs needs 'ground_truth'")
        instance_id = instance_id or str(uuid.uuid4())
        self.instances[instance_id] = {"response": "", "ground_truth": ground_truth}
        return instance_id

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]:
        self.instances[instance_id]["response"] = last_assistant_text(messages)
        reward = await self.calculate_score(instance_id)
        if reward == 1.0:
            return True, CORRECT, reward, {}
        return False, INCORRECT, reward, {}

    async def calculate_score(self, instance_id: str, **kwargs: Any) -> float:
        state = self.instances[instance_id]
        return float(gsm8k_score(state["response"], state["ground_truth"], method="strict"))
