"""A corridor of rooms between a code the model is told and the exit where it must say it.

The task (the dataset prompt) gives a code. Whatever the model replies, the env shows it `rooms` rooms,
each described at length (the descriptions carry no numbers), then asks for the code at the exit. The
reward is 1 when the reply at the exit contains the code, else 0. So the information needed at the end
appears at the start, and the room descriptions make the history outgrow a small context window.
"""

from __future__ import annotations

import random
from typing import Any

from verl_agent.interactions.base import BaseInteraction

_WORDS = ("stone", "quiet", "lamp", "door", "wall", "long", "dark", "cold", "hall", "arch", "floor", "dust",
          "window", "shadow", "step", "old", "wide", "narrow", "painted", "empty")
ROOMS, WORDS = 4, 40  # the corridor of interaction.yaml (warm_start.py trains on the same)
PROMPT = "Remember the code {code}. Walk through the rooms; at the exit, tell me the code."
EXIT = "You reached the exit. What is the code?"


def room_text(k: int, seed: int, words: int = WORDS) -> str:
    """Room k's description (fixed by the trajectory's seed)."""
    rng = random.Random(seed * 1009 + k)
    return f"Room {'ABCDEFGHIJKLMNOP'[k % 16]}: {' '.join(rng.choice(_WORDS) for _ in range(words))}. Walk on."


class CorridorInteraction(BaseInteraction):
    """interaction_kwargs: `code` (the answer), `seed` (the rooms' text); config: `rooms`, `words` per room."""

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        iid = await super().start_interaction(instance_id, **kwargs)
        if "code" not in kwargs:
            raise ValueError("CorridorInteraction needs interaction_kwargs['code']")
        self.instances[iid].update(room=0, code=str(kwargs["code"]), seed=int(kwargs.get("seed", 0)))
        return iid

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
                                ) -> tuple[bool, str, float, dict[str, Any]]:  # fmt: skip
        st = self.instances[instance_id]
        rooms, words = int(self.config.get("rooms", ROOMS)), int(self.config.get("words", WORDS))
        if st["room"] > rooms:  # the reply to the exit's question
            st["score"] = float(st["code"] in (messages[-1].get("content") or ""))
            return True, "Goodbye.", st["score"], {}
        st["room"] += 1
        if st["room"] > rooms:
            return False, EXIT, 0.0, {}
        return False, room_text(st["room"] - 1, st["seed"], words), 0.0, {}
