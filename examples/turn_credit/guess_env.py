"""Higher/lower with a state you can read: the environment of the turn-credit example.

The secret is an integer in [low, high]; the model has `max_guesses` guesses. After a wrong guess the
reply names the whole state, "Too low. It is from 9 to 15. 3 guesses left.", so equal replies mean
equal states (GiGPO's anchor states), and `info["state_key"]` names the state too.

Reward per turn (the env's step reward, the turn's score):
- `shaping` x (candidates the guess ruled out) / (high - low + 1): a guess near the middle of the
  interval rules out the most; a guess outside it rules out nothing. Over an episode this sums to
  less than `shaping`, plus `shaping` x (the candidates left) on the winning guess, so
- a won episode scores 1 + shaping in total and a lost one less than `shaping` (success = reward >= 1).
With `shaping: 0` the reward is 1 on the winning guess only (outcome only).

Binary search wins every game of 1..15 in 4 guesses; guessing uniformly inside the interval wins 60 %.
"""

from __future__ import annotations

import re
import string
from typing import Any

import gymnasium
from gymnasium import spaces

_INTEGER = re.compile(r"-?\d+")


class HiLoGame(gymnasium.Env):
    """Find the secret in [low, high] within `max_guesses`; see the module docstring for the rewards."""

    metadata = {"render_modes": []}

    def __init__(self, low: int = 1, high: int = 15, max_guesses: int = 4, shaping: float = 0.5):
        if not low < high or max_guesses < 1 or not 0 <= shaping < 1:
            raise ValueError(f"HiLoGame: need low < high, max_guesses >= 1 and 0 <= shaping < 1, got "
                             f"{low}, {high}, {max_guesses}, {shaping}")
        self.low, self.high, self.max_guesses, self.shaping = low, high, max_guesses, shaping
        self.observation_space = spaces.Text(max_length=200, charset=string.printable)
        self.action_space = spaces.Text(max_length=2000, charset=string.printable)
        self.secret, self.lo, self.hi, self.left = low, low, high, max_guesses

    def state_key(self) -> str:
        return f"{self.lo}-{self.hi}-{self.left}"

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict]:
        super().reset(seed=seed)
        options = options or {}
        self.secret = int(options.get("secret", self.np_random.integers(self.low, self.high + 1)))
        self.lo, self.hi, self.left = self.low, self.high, self.max_guesses
        return f"Guess my number from {self.lo} to {self.hi}. {self.left} guesses left.", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        numbers = _INTEGER.findall(action or "")
        guess = int(numbers[-1]) if numbers else None
        before, size = self.hi - self.lo + 1, self.high - self.low + 1
        self.left -= 1
        if guess == self.secret:
            reward = 1.0 + self.shaping * before / size
            return "Correct!", reward, True, False, {"state_key": "won", "won": True}
        if guess is None:
            hint = "No number."
        elif guess < self.secret:
            hint, self.lo = "Too low.", max(self.lo, guess + 1)
        else:
            hint, self.hi = "Too high.", min(self.hi, guess - 1)
        reward = self.shaping * (before - (self.hi - self.lo + 1)) / size
        info = {"state_key": self.state_key(), "won": False}
        if self.left == 0:
            return f"{hint} No guesses left; it was {self.secret}.", reward, False, True, info
        return f"{hint} It is from {self.lo} to {self.hi}. {self.left} guesses left.", reward, False, False, info
