"""A corridor of rooms between a question and the place where its answer counts.

The task (the dataset prompt) asks an arithmetic question. Whatever the model replies, the env walks it
through `rooms` rooms, each described at length (the descriptions carry no numbers), and then asks for the
answer at the exit. The reward is 1 when the exit reply contains the answer, else 0. So the information
needed at the end (the question, and the answer the model worked out on its first turns) appears at the
start, and the room descriptions make the history outgrow a small context window.
"""

from __future__ import annotations

import random
from typing import Any

from verl_agent.interactions.base import BaseInteraction

_WORDS = ("Hello!", "Thank you, that is correct.", "How can I help you today?", "Here is the result of the tool call.")
EXIT = "Please answer the question."


def room_text(k: int, rooms: int, words: int, seed: int) -> str:
    rng = random.Random(seed * 1009 + k)
    desc = " ".join(rng.choice(_WORDS) for _ in range(words))
    return f"Room {'ABCDEFGHIJKLMNOP'[k]}. {desc}"


class CorridorInteraction(BaseInteraction):
    """interaction_kwargs: `answer` (str), `seed` (int); config: `rooms` (default 6), `words` per room (40)."""

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        iid = await super().start_interaction(instance_id, **kwargs)
        self.instances[iid].update(room=0, answer=str(kwargs["answer"]), seed=int(kwargs.get("seed", 0)))
        return iid

    async def generate_response(self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
                                ) -> tuple[bool, str, float, dict[str, Any]]:  # fmt: skip
        st = self.instances[instance_id]
        rooms, words = int(self.config.get("rooms", 6)), int(self.config.get("words", 40))
        if st["room"] > rooms:  # the reply to the exit question
            st["score"] = float(st["answer"] in (messages[-1].get("content") or ""))
            return True, "Goodbye.", st["score"], {}
        st["room"] += 1
        if st["room"] > rooms:
            return False, EXIT, 0.0, {}
        return False, room_text(st["room"] - 1, rooms, words, st["seed"]), 0.0, {}
