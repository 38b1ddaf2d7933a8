"""A format warm start for the tiny model: it learns to carry the code in its own replies.

    python examples/long_horizon/warm_start.py        # prints the model folder (built once, then cached)

The embedded tiny model only knows calculator chats. This short SFT trains it on corridors played the
one way that needs no long-range memory: every reply restates the code ("The code is N."), so the reply at
the exit is right if the model copies the code from its own last reply (or the task). One sample per reply,
in the context that config.yaml's `drop_observations` (keep_last_turns=0, trigger_length=200) leaves
before it: the task, the earlier replies, and every room (the latest too) as a placeholder. Both
strategies of the comparison start from this same model; training codes only (make_data.py holds every
5th code out), so held-out success needs copying, not a memorised code. The folder is keyed by a hash of the recipe under ~/.cache/verl_agent.
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
    recipe_version: int = 4  # 4: every reply states the code; contexts of keep_last_turns=0
    n_corridors: int = 300
    steps: int = 120
    batch_size: int = 8
    lr: float = 1e-3
    warmup_steps: int = 10
    seed: int = 0

    def key(self, base: str) -> str:
        sys.path.insert(0, str(HERE))
        from corridor import EXIT, PROMPT, ROOMS, WORDS

        task = {"prompt": PROMPT, "exit": EXIT, "rooms": ROOMS, "words": WORDS}
        blob = json.dumps({**dataclasses.asdict(self), "base": base, "task": task}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def corridor_chat(code: int, seed: int) -> list:
    """One corridor played the intended way, as chat messages."""
    from corridor import EXIT, PROMPT, ROOMS, room_text

    from verl_agent.protocol import Message

    reply = Message("assistant", f"The code is {code}.")  # every reply restates it: the model's own notes
    msgs = [Message("user", PROMPT.format(code=code)), reply]
    for k in range(ROOMS):
        msgs += [Message("user", room_text(k, seed)), reply]
    return [*msgs, Message("user", EXIT), reply]


def encode(w: WarmStart) -> Callable[[Any, Any], list]:
    """The SFT rows: one per reply, in the context config.yaml's strategy leaves before it."""
    def rows(tok: Any, model: Any) -> list:
        sys.path.insert(0, str(HERE))
        from make_data import TRAIN_CODES

        from verl_agent.chat import ChatEncoder
        from verl_agent.models.sft_data import encode_conversation
        from verl_agent.rollout.context import drop_observations

        rng, enc, data = random.Random(w.seed), ChatEncoder(tok), []
        for _ in range(w.n_corridors):
            chat = corridor_chat(rng.choice(TRAIN_CODES), rng.randrange(1 << 20))
            for end in range(1, len(chat), 2):
                data.append(encode_conversation(enc, [*drop_observations(chat[:end], 1, 0), chat[end]]))
        return data
    return rows


def warm_start(w: WarmStart | None = None, cache: Path | None = None) -> Path:
    """The warm-started model folder (built on first use; concurrent callers wait for one build)."""
    from verl_agent.models.tiny import build_tiny
    from verl_agent.models.warm_start import warm_start as cached_sft

    w = w or WarmStart()
    base = str(build_tiny())
    return cached_sft("long-horizon", w, base, w.key(base), encode(w), last=10, cache=cache)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    print(warm_start())
