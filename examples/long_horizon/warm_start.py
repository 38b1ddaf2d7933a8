"""A format warm start for the tiny model: it learns the corridor's replies on compacted histories.

    python examples/long_horizon/warm_start.py        # prints the model folder (built once, then cached)

The embedded tiny model only knows calculator chats. This short SFT trains it on corridors played the
intended way ("Next." in every room, "The code is N." at the exit): one sample per reply, in the context
`context.strategy=drop_observations` (keep_last_turns=1) leaves before it: the task, the earlier replies,
earlier rooms as placeholders and the latest room in full. (Whole histories, ~1000 tokens each, were 3x
slower per step.) Both strategies of the comparison start from this same model; training codes only
(make_data.py holds every 5th code out). The folder is keyed by a hash of the recipe under ~/.cache/verl_agent.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import random
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class WarmStart:
    recipe_version: int = 3  # 3: one sample per reply, in the context drop_observations leaves before it
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

    msgs = [Message("user", PROMPT.format(code=code)), Message("assistant", "Next.")]
    for k in range(ROOMS):
        msgs += [Message("user", room_text(k, seed)), Message("assistant", "Next.")]
    return [*msgs, Message("user", EXIT), Message("assistant", f"The code is {code}.")]


def build(out: Path, base: str, w: WarmStart) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(HERE))
    from make_data import TRAIN_CODES

    from verl_agent.chat import ChatEncoder
    from verl_agent.models.sft_data import encode_conversation
    from verl_agent.models.sft_train import group_by_prefix, train
    from verl_agent.rollout.context import drop_observations

    t0 = time.perf_counter()
    torch.manual_seed(w.seed)
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    rng, enc = random.Random(w.seed), ChatEncoder(tok)
    data = []
    for _ in range(w.n_corridors):
        chat = corridor_chat(rng.choice(TRAIN_CODES), rng.randrange(1 << 20))
        for end in range(1, len(chat), 2):  # each reply, after the task and the latest room in full
            data.append(encode_conversation(enc, [*drop_observations(chat[:end], 1, 1), chat[end]]))
    losses = train(model, group_by_prefix(data, tok.convert_tokens_to_ids("<|im_end|>")), w, w.seed)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    info = {"settings": dataclasses.asdict(w), "base": base, "final_loss": round(sum(losses[-10:]) / 10, 4),
            "seconds": round(time.perf_counter() - t0, 1)}
    (out / "warm_start.json").write_text(json.dumps(info, indent=2))  # written last: marks the folder complete
    log.info("long-horizon warm start built in %.0f s (final loss %.3f)", info["seconds"], info["final_loss"])


def warm_start(w: WarmStart | None = None, cache: Path | None = None) -> Path:
    """The warm-started model folder (built on first use; concurrent callers wait for one build)."""
    from verl_agent.models.tiny import build_tiny, cache_root, cached_build

    w = w or WarmStart()
    base = str(build_tiny())
    target = (cache or cache_root()) / f"long-horizon-{w.key(base)}"
    return cached_build(target, "warm_start.json", lambda tmp: build(tmp, base, w))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    print(warm_start())
