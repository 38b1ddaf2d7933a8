"""`TinySettings`: the recipe of the embedded tiny model (models/tiny.py builds it, sft_train.py trains it)."""

from __future__ import annotations

import dataclasses
import hashlib
import json

__all__ = ["TinySettings"]


@dataclasses.dataclass(frozen=True)
class TinySettings:
    """Everything that determines the built model; its hash names the cache folder.

    The recipe aims at a model that calls the calculator in about half of its answers and copies the
    expression right when it does, so RL has both a decision and a skill to improve: many distinct
    problems (with few, the model memorises answers instead of learning to copy), 8 attention heads,
    most SFT chats calling the tool, with the call-or-answer decision trained towards
    `tool_call_prior` (decision_rates). scripts/tiny_sft_curve.py compares recipes.
    """

    recipe_version: int = 3
    vocab_size: int = 1024
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 8  # fewer heads copy expressions into tool calls far less reliably
    num_kv_heads: int = 8
    intermediate_size: int = 256
    n_train_problems: int = 16000
    tool_fraction: float = 0.8  # share of SFT chats that call the calculator (copying practice)
    tool_call_prior: float = 0.4  # call rate the call-or-answer decision is trained towards
    steps: int = 2000  # copying expressions is learnt late in SFT, well after copying results
    batch_size: int = 48
    lr: float = 3e-3
    warmup_steps: int = 30
    n_eval_problems: int = 128
    eval_temperature: float = 1.0  # rates are measured as RL samples: temperature 1

    def key(self, seed: int) -> str:
        blob = json.dumps({**dataclasses.asdict(self), "seed": seed}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]
