"""A text game written the Gymnasium way: guess the secret number, with "higher"/"lower" hints.

This is the file to copy for your own environment. The framework needs only
`reset` and `step` with text in and text out:

    reset(seed, options) -> (first message to the model, info)
    step(model's reply)  -> (next message, reward, terminated, truncated, info)

`terminated` means the episode reached its goal (the number was found);
`truncated` means it was cut short (no guesses left). One env object is made
per trajectory, so plain attributes are safe for per-episode state.
"""

from __future__ import annotations

import re
import string
from typing import Any

import gymnasium
from gymnasium import spaces

_INTEGER = re.compile(r"(?<!\d)-?\d{1,18}(?!\d)")  # longer digit runs are no guess (int() refuses 4300+ digits)


class GuessNumberGame(gymnasium.Env):
    """Find a secret integer in [low, high] within `max_guesses`; reward 1.0 on the winning guess."""

    metadata = {"render_modes": []}

    def __init__(self, low: int = 1, high: int = 15, max_guesses: int = 4):
        if not low < high or max_guesses < 1:
            raise ValueError(f"GuessNumberGame: need low < high and max_guesses >= 1, got {low}, {high}, {max_guesses}")
        self.low, self.high, self.max_guesses = low, high, max_guesses
        # Text spaces default to letters and digits only; the messages use punctuation and spaces too.
        self.observation_space = spaces.Text(max_length=2000, charset=string.printable)
        self.action_space = spaces.Text(max_length=2000, charset=string.printable)
        self.secret, self.guesses = low, 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict]:
        super().reset(seed=seed)  # seeds self.np_random
        options = options or {}
        # A dataset row may fix the secret (options come from its interaction_kwargs); else draw one.
        self.secret = int(options.get("secret", self.np_random.integers(self.low, self.high + 1)))
        self.guesses = 0
        text = (f"I picked a whole number from {self.low} to {self.high}. You have {self.max_guesses} guesses. "
                "Reply with one number.")
        return text, {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        self.guesses += 1
        left = self.max_guesses - self.guesses
        numbers = _INTEGER.findall(action or "")
        guess = int(numbers[-1]) if numbers else None  # the last number in the reply is the guess
        if guess == self.secret:
            return f"Correct, it is {self.secret}!", 1.0, True, False, {"guesses": self.guesses}
        if guess is None:
            hint = "I found no number in your reply."
        elif not self.low <= guess <= self.high:
            hint = f"{guess} is outside {self.low}..{self.high}."
        else:
            hint = f"{guess} is too {'low' if guess < self.secret else 'high'}."
        if left == 0:
            return f"{hint} No guesses left; it was {self.secret}.", 0.0, False, True, {"guesses": self.guesses}
        return f"{hint} {left} left.", 0.0, False, False, {"guesses": self.guesses}
