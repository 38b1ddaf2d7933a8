"""`verl-agent model build-tiny`: the embedded tiny tool-calling model, built locally, no downloads.

Recipe: train a byte-level BPE tokenizer on synthetic calculator chats, create a
small Qwen2 causal LM, warm-start it by supervised training on those chats
(some call the calculator, some answer from "mental math"), evaluate it by real
generation, and save it with `save_pretrained`. The result is cached under
$VERL_AGENT_CACHE (default ~/.cache/verl_agent) in a folder keyed by a hash of
the recipe, so a changed recipe rebuilds. Builds are atomic (temp dir +
rename) and serialised by a file lock, so concurrent test sessions share one
build and a killed build never looks cached.

The default build (recipe and seed 0) ships with the package in `tiny_prebuilt/`, so a fresh
clone starts without running the SFT; it is copied into the cache. `--force` (and any
other recipe or seed) builds from the recipe; tests/models/test_tiny_rebuild.py rebuilds the default
one and compares it with the shipped files.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

from verl_agent.models.tiny_settings import TinySettings
from verl_agent.paths import cache_root

__all__ = ["PREBUILT", "TinySettings", "add_cli", "build_tiny", "cached_build", "prebuilt_key", "run_cli"]

log = logging.getLogger(__name__)
INFO_FILE = "build_info.json"
PREBUILT = Path(__file__).with_name("tiny_prebuilt")


def cached_build(target: Path, marker: str, build: Callable[[Path], None], force: bool = False) -> Path:
    """`target`, built by `build(tmp_dir)` unless `target/marker` exists (or `force`); returns `target`.

    `build` must write `marker` last. The folder is built in a temporary sibling and renamed into place,
    so a reader never sees half of it, and a file lock makes concurrent callers wait for one build.
    """
    if (target / marker).exists() and not force:
        return target
    foreign = target.is_dir() and not (target / marker).exists() and any(target.iterdir())
    if foreign and not target.resolve().is_relative_to(cache_root().resolve()):
        # a folder the user named (--out) that is not a build of ours: never emptied to make room
        raise FileExistsError(f"{target} holds files but no {marker}: it is not a build of ours, so it is not "
                              "replaced; give a new or empty folder")
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building the same folder: wait for it
        if (target / marker).exists() and not force:
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            build(tmp)
            if target.exists():
                shutil.rmtree(target)
            os.rename(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def build_tiny(out_dir: str | Path | None = None, seed: int = 0, force: bool = False,
               settings: TinySettings | None = None) -> Path:
    """Build (or reuse) the tiny model; returns a folder `from_pretrained` can load."""
    settings = settings or TinySettings()
    target = Path(out_dir) if out_dir is not None else cache_root() / f"tiny-{settings.key(seed)}"

    def build(tmp: Path) -> None:
        if not force and prebuilt_key() == settings.key(seed):
            shutil.copytree(PREBUILT, tmp, dirs_exist_ok=True)
        else:
            _build_into(tmp, seed, settings)

    return cached_build(target, INFO_FILE, build, force)


def prebuilt_key() -> str | None:
    """The recipe key of the shipped build (None when the package has none)."""
    if not (PREBUILT / INFO_FILE).exists():
        return None
    info = build_info(PREBUILT)
    return TinySettings(**info["settings"]).key(info["seed"])


def _build_into(out: Path, seed: int, s: TinySettings) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from verl_agent.models.calculator_task import make_problems
    from verl_agent.models.evaluate import evaluate_rates
    from verl_agent.models.sft_train import make_dataset, train

    t0 = time.perf_counter()
    torch.manual_seed(seed)
    tokenizer, data = make_dataset(make_problems(s.n_train_problems, seed=seed, split="train"), s, seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_layers, num_attention_heads=s.num_heads, num_key_value_heads=s.num_kv_heads,
        max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=10000.0,
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    model = Qwen2ForCausalLM(config)
    train(model, data, s, seed)
    rates = evaluate_rates(model, tokenizer, make_problems(s.n_eval_problems, seed=seed + 1, split="test"),
                           temperature=s.eval_temperature, seed=seed)
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, tokenizer.pad_token_id]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    info = {"settings": dataclasses.asdict(s), "seed": seed, "tool_call_rate": rates.tool_call_rate,
            "success_rate": rates.success_rate, "n_eval": rates.n, "eval_temperature": s.eval_temperature,
            "num_parameters": sum(p.numel() for p in model.parameters()), "vocab_size": len(tokenizer),
            "build_seconds": round(time.perf_counter() - t0, 1)}
    (out / INFO_FILE).write_text(json.dumps(info, indent=2))  # written last: its presence means "complete"
    log.info("tiny model built in %.0f s: tool-call rate %.2f, success rate %.2f",
             info["build_seconds"], rates.tool_call_rate, rates.success_rate)


def build_info(path: str | Path) -> dict[str, Any]:
    """The builder's record (settings, rates, timing) of a built model folder."""
    return json.loads((Path(path) / INFO_FILE).read_text())


def add_cli(subparsers: Any) -> None:
    """Register `model build-tiny` under a `model` subcommand's subparsers."""
    p = subparsers.add_parser("build-tiny", help="build the embedded tiny tool-calling model (no downloads)")
    p.add_argument("--out", default=None, help="output folder (default: the cache, $VERL_AGENT_CACHE)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="rebuild even if cached")
    p.set_defaults(func=run_cli)


def run_cli(args: argparse.Namespace) -> int:
    path = build_tiny(args.out, seed=args.seed, force=args.force)
    info = build_info(path)
    print(f"tiny model: {path}")
    print(f"held-out tool-call rate: {info['tool_call_rate']:.2f}  success rate: {info['success_rate']:.2f}  "
          f"(n={info['n_eval']}, temperature {info['eval_temperature']}, built in {info['build_seconds']} s)")
    return 0


if __name__ == "__main__":  # python -m verl_agent.models.tiny
    logging.basicConfig(level=logging.INFO)
    _p = argparse.ArgumentParser(prog="build-tiny")
    add_cli(_p.add_subparsers(dest="cmd", required=True))
    _a = _p.parse_args(["build-tiny", *sys.argv[1:]])
    raise SystemExit(_a.func(_a))
