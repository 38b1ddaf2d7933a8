"""The examples' warm starts: a short SFT of a base model on chats an example writes, kept as a cached model folder.

    path = warm_start("turn-credit", settings, base, key, encode=lambda tok, model: rows)

`encode(tokenizer, model)` returns the rows to train on (``sft_data.encode_conversation`` pairs; the model is
there for an example that measures it before training); `evaluate(model, tokenizer)` adds figures of the
trained model to ``warm_start.json``. The folder ``<cache>/<name>-<key>`` holds the model, its tokenizer and
``warm_start.json`` (settings, base, final loss, seconds), written last: it marks the folder complete, and
concurrent callers wait for one build (`tiny.cached_build`). The key is the example's hash of its recipe.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

__all__ = ["MARKER", "SFTSettings", "sft_and_save", "warm_start"]

log = logging.getLogger(__name__)

MARKER = "warm_start.json"
Rows = list[tuple[list[int], list[int]]]


class SFTSettings(Protocol):
    """A frozen dataclass with what `sft_train.train` reads (steps, batch_size, lr, warmup_steps) and a seed."""

    seed: int
    steps: int


def warm_start(name: str, settings: SFTSettings, base: str, key: str, encode: Callable[[Any, Any], Rows], *,
               evaluate: Callable[[Any, Any], dict[str, Any]] | None = None, device: str = "cpu",
               last: int = 20, cache: Path | None = None) -> Path:  # fmt: skip
    """The folder ``<cache or ~/.cache/verl_agent>/<name>-<key>``, built by `sft_and_save` on first use."""
    from verl_agent.models.tiny import cached_build
    from verl_agent.paths import cache_root

    target = (cache or cache_root()) / f"{name}-{key}"
    return cached_build(target, MARKER, lambda tmp: sft_and_save(
        tmp, base, settings, encode, evaluate=evaluate, device=device, last=last, name=name))


def sft_and_save(out: Path, base: str, settings: SFTSettings, encode: Callable[[Any, Any], Rows], *,
                 evaluate: Callable[[Any, Any], dict[str, Any]] | None = None, device: str = "cpu", last: int = 20,
                 name: str = "warm start") -> dict[str, Any]:  # fmt: skip
    """SFT `base` on `encode`'s rows (grouped by shared prefix), save model and tokenizer into `out`, then
    ``warm_start.json``; returns what it wrote. The loss reported is the mean of the `last` steps."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_agent.models.sft_train import group_by_prefix, train

    t0 = time.perf_counter()
    torch.manual_seed(settings.seed)
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).to(device)
    rows = encode(tok, model)
    losses = train(model, group_by_prefix(rows, tok.convert_tokens_to_ids("<|im_end|>")), settings, settings.seed)
    figures = evaluate(model, tok) if evaluate is not None else {}
    model.save_pretrained(out)
    tok.save_pretrained(out)
    tail = losses[-last:]
    info = {"settings": dataclasses.asdict(settings), "base": base, "device": device,  # type: ignore[call-overload]
            "final_loss": round(sum(tail) / len(tail), 4), **figures, "seconds": round(time.perf_counter() - t0, 1)}
    (out / MARKER).write_text(json.dumps(info, indent=2))  # written last: marks the folder complete
    log.info("%s warm start built in %.0f s on %d rows (final loss %.3f)%s", name, info["seconds"], len(rows),
             info["final_loss"], "".join(f", {k} {v}" for k, v in figures.items()))
    return info
