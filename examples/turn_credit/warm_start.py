"""A task-format warm start for the tiny model: it learns to play higher/lower legally, not well.

    python examples/turn_credit/warm_start.py        # prints the model folder (built once, then cached)

The embedded tiny model only knows calculator chats. This short SFT (about 110 s on 2 CPU cores) trains
it on matches in which the "player" guesses uniformly at random inside the interval the replies name:
the policy learns the format (one number per turn) and to stay inside the interval, not the strategy
(the middle of the interval). That random player wins 67 % of the rounds of 1..7 and 21 % of the
four-round matches; binary search wins all. (The warm-started policy itself wins about 18 % of the
evaluation matches: it imitates the random player imperfectly.) The folder is keyed by a hash of the
recipe under ~/.cache/verl_agent.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


@dataclasses.dataclass(frozen=True)
class WarmStart:
    recipe_version: int = 3  # 3: the four-round game of make_data.py (2: two rounds of 1..7; 1: one round of 1..15)
    n_games: int = 3000
    steps: int = 100
    batch_size: int = 32
    lr: float = 1e-3
    warmup_steps: int = 20
    seed: int = 0

    def key(self, base: str) -> str:
        sys.path.insert(0, str(HERE))
        from make_data import GUESSES, HIGH, LOW, ROUNDS  # the game's text is what the warm start learns

        game = {"low": LOW, "high": HIGH, "guesses": GUESSES, "rounds": ROUNDS}
        blob = json.dumps({**dataclasses.asdict(self), "base": base, "game": game}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def random_player_game(env, rng: random.Random, prompt: str) -> list:
    """One game of the random-inside-the-interval player, as chat messages."""
    from verl_agent.protocol import Message

    obs, _ = env.reset(seed=rng.randrange(1 << 30))
    msgs = [Message("user", prompt), Message("user", obs)]
    while True:
        guess = rng.randint(env.lo, env.hi)
        msgs.append(Message("assistant", str(guess)))
        obs, _, terminated, truncated, _ = env.step(str(guess))
        if terminated or truncated:
            return msgs
        msgs.append(Message("user", obs))


def encode(w: WarmStart) -> Callable[[Any, Any], list]:
    """The SFT rows: games of a random player (`random_player_game`)."""
    def rows(tok: Any, model: Any) -> list:
        sys.path.insert(0, str(HERE))
        from guess_env import HiLoGame
        from make_data import GUESSES, HIGH, LOW, PROMPT, ROUNDS

        from verl_agent.chat import ChatEncoder
        from verl_agent.models.sft_data import encode_conversation

        rng, enc = random.Random(w.seed), ChatEncoder(tok)
        env = HiLoGame(low=LOW, high=HIGH, max_guesses=GUESSES, rounds=ROUNDS, shaping=0.0)
        return [encode_conversation(enc, random_player_game(env, rng, PROMPT)) for _ in range(w.n_games)]
    return rows


def warm_start(w: WarmStart | None = None, cache: Path | None = None) -> Path:
    """The warm-started model folder (built on first use; concurrent callers wait for one build)."""
    from verl_agent.models.tiny import build_tiny
    from verl_agent.models.warm_start import warm_start as cached_sft

    w = w or WarmStart()
    base = str(build_tiny())
    return cached_sft("turn-credit", w, base, w.key(base), encode(w), cache=cache)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    print(warm_start())
