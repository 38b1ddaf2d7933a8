"""Guess-the-number: a small text game written the Gymnasium way (passes check_env).

The env picks a secret integer in [low, high]; each action is the model's text,
from which the last integer is taken as the guess. The reply says "higher" or
"lower". Reward: 1.0 on the turn the number is found (terminated), else 0.0;
after `max_turns` guesses the episode is truncated. Actions without a number
cost a turn and get a hint on the expected format.
"""

from __future__ import annotations

import re
import string
from typing import Any

import gymnasium
from gymnasium import spaces

__all__ = ["GuessNumberEnv", "ENV_ID"]

ENV_ID = "verl_agent/GuessNumber-v0"
_INT = re.compile(r"(?<!\d)-?\d{1,18}(?!\d)")  # longer digit runs are no guess (int() refuses 4300+ digits)
MAX_TEXT = 4096


class GuessNumberEnv(gymnasium.Env):
    """Higher/lower guessing game with `spaces.Text` observations and actions (charset string.printable)."""

    metadata = {"render_modes": []}

    def __init__(self, low: int = 1, high: int = 100, max_turns: int = 7):
        if low >= high:
            raise ValueError(f"GuessNumberEnv: low ({low}) must be below high ({high})")
        if max_turns < 1:
            raise ValueError(f"GuessNumberEnv: max_turns must be >= 1, got {max_turns}")
        self.low, self.high, self.max_turns = low, high, max_turns
        # spaces.Text defaults to letters+digits only: the prose below needs printable characters.
        self.observation_space = spaces.Text(max_length=MAX_TEXT, charset=string.printable)
        self.action_space = spaces.Text(max_length=MAX_TEXT, charset=string.printable)
        self.secret = low
        self.turns = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict]:
        super().reset(seed=seed)
        options = options or {}
        self.secret = int(options.get("secret", self.np_random.integers(self.low, self.high + 1)))
        self.turns = 0
        obs = (
            f"I am thinking of an integer between {self.low} and {self.high}. "
            f"You have {self.max_turns} guesses. Reply with your guess."
        )
        return obs, {"low": self.low, "high": self.high}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        self.turns += 1
        numbers = _INT.findall(action or "")
        left = self.max_turns - self.turns
        truncated = left <= 0
        if not numbers:
            obs, reward, terminated = "I could not find a number in your reply. Reply with one integer.", 0.0, False
        else:
            guess = int(numbers[-1])
            terminated = guess == self.secret
            reward = 1.0 if terminated else 0.0
            if terminated:
                obs = f"Correct! The number was {self.secret}."
            else:
                low = guess < self.secret
                obs = f"{guess} is too {'low' if low else 'high'}. Guess {'higher' if low else 'lower'}."
        if truncated and not terminated:
            obs += f" No guesses left; the number was {self.secret}."
        elif not terminated:
            obs += f" {left} guess{'es' if left != 1 else ''} left."
        return obs, reward, terminated, truncated and not terminated, {"turns": self.turns}


def register() -> None:
    """Register ENV_ID with Gymnasium (idempotent)."""
    if ENV_ID not in gymnasium.registry:
        gymnasium.register(ENV_ID, entry_point=GuessNumberEnv)


register()
