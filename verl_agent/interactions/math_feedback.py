"""Math feedback: check the model's answer, say "try again" until it is right or turns run out.

Dataset row: `interaction_kwargs: {name: math_feedback, ground_truth: "72"}`.
Config (interaction YAML `config:`): `max_turns` (3), `correct_score` (1.0),
`incorrect_score` (0.0), `turn_penalty` (0.0: the reward for a correct answer
found on turn k is `correct_score - turn_penalty * (k - 1)`), `tolerance` (1e-6,
relative, for numeric answers).

The answer is read from, in order: the last `\\boxed{...}`, a `#### x` line, an
"answer is x" / "Answer: x" phrase, else the last number in the text.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

from verl_agent.interactions.base import BaseInteraction, last_assistant_text

__all__ = ["MathFeedbackInteraction", "extract_answer", "answers_match"]

_BOXED = re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}")
_HASHES = re.compile(r"####\s*([^\n]+)")
_PHRASE = re.compile(r"answer(?: is|:)\s*[:=]?\s*\$?([-+]?[\d,]*\.?\d+(?:/\d+)?)", re.IGNORECASE)
_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?(?:/\d+)?|[-+]?\.\d+")


def extract_answer(text: str) -> str | None:
    """The model's final answer as a string, or None when there is none."""
    for pattern in (_BOXED, _HASHES, _PHRASE):
        found = pattern.findall(text)
        if found:
            return found[-1].strip().rstrip(".")
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _to_number(s: str) -> float | None:
    s = s.strip().replace(",", "").replace("$", "").rstrip(".")
    try:
        if "/" in s:
            num, den = s.split("/", 1)
            return float(num) / float(den)
        return float(s)
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(answer: str | None, ground_truth: Any, tolerance: float = 1e-6) -> bool:
    """Numeric comparison with a relative tolerance when both parse as numbers, else normalised text."""
    if answer is None:
        return False
    a, b = _to_number(answer), _to_number(str(ground_truth))
    if a is not None and b is not None:
        return abs(a - b) <= tolerance * max(1.0, abs(b))
    return answer.strip().lower() == str(ground_truth).strip().lower()


class MathFeedbackInteraction(BaseInteraction):
    """Multi-turn math: "correct" ends the episode; otherwise "try again" up to `max_turns`."""

    def __init__(self, config: dict[str, Any] | None = None):
        super().__init__(config)
        self.max_turns = int(self.config.get("max_turns", 3))
        self.correct_score = float(self.config.get("correct_score", 1.0))
        self.incorrect_score = float(self.config.get("incorrect_score", 0.0))
        self.turn_penalty = float(self.config.get("turn_penalty", 0.0))
        self.tolerance = float(self.config.get("tolerance", 1e-6))
        if self.max_turns < 1:
            raise ValueError(f"{self.name}: config 'max_turns' must be >= 1, got {self.max_turns}")

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        if "ground_truth" not in kwargs:
            raise ValueError(f"{self.name}: interaction_kwargs needs 'ground_truth'")
        instance_id = instance_id or str(uuid.uuid4())
        self.instances[instance_id] = {"ground_truth": kwargs["ground_truth"], "turns": 0, "score": 0.0}
        return instance_id

    async def generate_response(
        self, instance_id: str, messages: list[dict[str, Any]], **kwargs: Any
    ) -> tuple[bool, str, float, dict[str, Any]]:
        state = self.instances[instance_id]
        state["turns"] += 1
        answer = extract_answer(last_assistant_text(messages))
        info = {"turn": state["turns"], "answer": answer}
        if answers_match(answer, state["ground_truth"], self.tolerance):
            score = self.correct_score - self.turn_penalty * (state["turns"] - 1)
            state["score"] = score
            return True, "Your answer is correct.", score, {**info, "correct": True}
        state["score"] = self.incorrect_score
        if state["turns"] >= self.max_turns:
            return True, "Your answer is incorrect. No attempts left.", self.incorrect_score, {**info, "correct": False}
        left = self.max_turns - state["turns"]
        reply = f"Your answer is incorrect. Please check your work and try again ({left} attempts left)."
        return False, reply, self.incorrect_score, {**info, "correct": False}
