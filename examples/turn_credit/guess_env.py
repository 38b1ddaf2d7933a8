"""Higher/lower with a state you can read: the environment of the turn-credit example.

The secret is an integer in [low, high]; the player has `max_guesses` guesses. After a wrong guess the
reply names the whole state, "Too low. It is from 9 to 15. 3 guesses left.", so equal replies mean
equal states (GiGPO's anchor states), and `info["state_key"]` names the state too. With `rounds` > 1 a
match is that many games in a row, each with its own secret: the next round starts when one ends, won or
lost ("... Round 2 of 4. Guess my number from 1 to 7. 3 guesses left."), and state keys carry the round
("2:1-7-3").

Reward per turn (the env's step reward, the turn's score), divided by `rounds` (each round is worth 1/rounds):
- scoring "halving" (the example's): `shaping` x balance(guess), balance = how evenly the guess splits
  the interval the last reply named (1 at the middle, 0 at either end, 0 outside the interval or for no
  number); the winning guess earns 1 on top. A guess is scored on its own, whatever the other turns did.
- scoring "ruled_out" (the default; the example's first version): `shaping` x (candidates the guess
  ruled out) / (high - low + 1); over a game this sums to less than `shaping`, plus `shaping` x (the
  candidates left) on the winning guess.
The constructor checks that a match with a lost round scores under 1 and a won one at least 1, so
success (reward >= 1) = every round won. With `shaping: 0` the reward is 1/rounds per won round only.

Secrets: `reset(options={"secrets": [...]})` plays those (the evaluation matches). Without them, the env
draws the secrets. With `random_secrets: false` the draw comes from `reset(seed=...)`, so every trajectory
reset with one seed (all the samples of one data row) plays the same match. With `random_secrets: true`
(the example's), each reset draws its own match: the k-th reset with seed s in this process uses
numpy's default_rng([s, k]), so the samples of one row (one GRPO group) face different secrets, and a run
is reproducible per seed when its rows are used once and in the same order.

Binary search wins every game of 1..7 in 3 guesses (and of 1..15 in 4); guessing uniformly inside the
interval wins 67 % (60 %) of the games, so 46 % of two-round matches of 1..7 and 21 % of four-round
matches (the example's game).
"""

from __future__ import annotations

import re
import string
from typing import Any

import gymnasium
import numpy as np
from gymnasium import spaces

_INTEGER = re.compile(r"(?<!\d)-?\d{1,18}(?!\d)")  # longer digit runs are no guess (int() refuses 4300+ digits)
SCORINGS = ("ruled_out", "halving")


def balance(guess: int | None, lo: int, hi: int) -> float:
    """How evenly `guess` splits [lo, hi]: the smaller side over the best possible smaller side (1 at the
    middle, or either middle of an even interval; 0 at either end of 3 or more; 1 for 1 or 2 candidates); 0
    for a guess outside the interval or no number."""
    if guess is None or not lo <= guess <= hi:
        return 0.0
    return 1.0 if hi - lo <= 1 else min(guess - lo, hi - guess) / ((hi - lo) // 2)


class HiLoGame(gymnasium.Env):
    """Find the secret in [low, high] within `max_guesses`, `rounds` times in a row (a new secret each round);
    see the module docstring for the rewards."""

    metadata = {"render_modes": []}
    _draws: dict[int, int] = {}  # random_secrets: how many matches each reset seed has drawn in this process

    def __init__(self, low: int = 1, high: int = 15, max_guesses: int = 4, shaping: float = 0.5,
                 scoring: str = "ruled_out", rounds: int = 1, random_secrets: bool = False):
        if not low < high or max_guesses < 1 or rounds < 1 or not 0 <= shaping < 1 or scoring not in SCORINGS:
            raise ValueError(f"HiLoGame: need low < high, max_guesses >= 1, rounds >= 1, 0 <= shaping < 1 and "
                             f"scoring in {SCORINGS}, got {low}, {high}, {max_guesses}, {rounds}, {shaping}, "
                             f"{scoring!r}")
        per_round = shaping * (max_guesses if scoring == "halving" else 1)  # the most shaping one round can earn
        if per_round * rounds >= 1:
            raise ValueError(f"HiLoGame: a match with a lost round must score under 1: need rounds x shaping "
                             f"{'x max_guesses ' if scoring == 'halving' else ''}< 1, got {rounds} x {shaping}")
        self.low, self.high, self.max_guesses, self.shaping, self.scoring = low, high, max_guesses, shaping, scoring
        self.rounds, self.random_secrets = rounds, random_secrets
        self.observation_space = spaces.Text(max_length=200, charset=string.printable)
        self.action_space = spaces.Text(max_length=2000, charset=string.printable)
        self.secrets, self.round = [low] * rounds, 0
        self.secret, self.lo, self.hi, self.left = low, low, high, max_guesses

    def state_key(self) -> str:
        key = f"{self.lo}-{self.hi}-{self.left}"
        return key if self.rounds == 1 else f"{self.round + 1}:{key}"

    def _round_start(self) -> str:
        self.secret = self.secrets[self.round]
        self.lo, self.hi, self.left = self.low, self.high, self.max_guesses
        text = f"Guess my number from {self.lo} to {self.hi}. {self.left} guesses left."
        return text if self.rounds == 1 else f"Round {self.round + 1} of {self.rounds}. {text}"

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict]:
        super().reset(seed=seed)
        options = options or {}
        if "secrets" in options:
            secrets = [int(x) for x in options["secrets"]]
        elif "secret" in options:
            secrets = [int(options["secret"])]
        else:
            rng = self.np_random
            if self.random_secrets and seed is not None:  # a new match per trajectory, reproducible per seed
                draw = HiLoGame._draws.get(seed, 0)
                HiLoGame._draws[seed] = draw + 1
                rng = np.random.default_rng([seed, draw])
            secrets = [int(x) for x in rng.integers(self.low, self.high + 1, size=self.rounds)]
        if len(secrets) != self.rounds:
            raise ValueError(f"HiLoGame: {self.rounds} rounds need {self.rounds} secrets, got {secrets}")
        self.secrets, self.round = secrets, 0
        return self._round_start(), {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        numbers = _INTEGER.findall(action or "")
        guess = int(numbers[-1]) if numbers else None
        before, size = self.hi - self.lo + 1, self.high - self.low + 1
        self.left -= 1
        turn_score = self.shaping * balance(guess, self.lo, self.hi)
        won = guess == self.secret
        if won:
            hint = "Correct!"
            reward = 1.0 + (turn_score if self.scoring == "halving" else self.shaping * before / size)
        else:
            if guess is None:
                hint = "No number."
            elif guess < self.secret:
                hint, self.lo = "Too low.", max(self.lo, guess + 1)
            else:
                hint, self.hi = "Too high.", min(self.hi, guess - 1)
            if self.scoring == "halving":
                reward = turn_score
            else:
                reward = self.shaping * (before - (self.hi - self.lo + 1)) / size
        reward /= self.rounds  # each round is worth 1 / rounds: the match scores >= 1 exactly when every round is won
        if not won and self.left > 0:
            info = {"state_key": self.state_key(), "won": False}
            return f"{hint} It is from {self.lo} to {self.hi}. {self.left} guesses left.", reward, False, False, info
        text = hint if won else f"{hint} No guesses left; it was {self.secret}."
        self.round += 1
        if self.round < self.rounds:  # the next round starts
            text = f"{text} {self._round_start()}"
            return text, reward, False, False, {"state_key": self.state_key(), "won": won}
        if won:
            return text, reward, True, False, {"state_key": "won" if self.rounds == 1 else "end", "won": True}
        info = {"state_key": f"{self.lo}-{self.hi}-0" if self.rounds == 1 else "end", "won": False}
        return text, reward, False, True, info
