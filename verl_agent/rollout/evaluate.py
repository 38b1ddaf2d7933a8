"""Rollouts from a run config: engine, tools, interactions, reward and sampling built from `RunConfig`.

`verl-agent rollout CONFIG [overrides]` (evaluation) calls `evaluate_cli`; the
trainer uses `build_engine`, `build_agent_loop` and `sampling_params`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

from verl_agent.protocol import RolloutBatch, Sample
from verl_agent.rollout.agent_loop import AgentLoop
from verl_agent.rollout.engine import Engine, SamplingParams
from verl_agent.rollout.metrics import summarize
from verl_agent.rollout.records import write_records

logger = logging.getLogger(__name__)

__all__ = [
    "build_agent_loop", "build_engine", "evaluate", "evaluate_cli", "load_reward", "model_path", "pick_device",
    "sampling_params",
]  # fmt: skip


def pick_device(cfg: Any) -> str:
    """trainer.device, with "auto" meaning cuda when available."""
    import torch

    want = cfg.trainer.device
    if want == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("trainer.device=cuda but torch sees no CUDA device")
    return "cuda" if want == "cuda" or (want == "auto" and torch.cuda.is_available()) else "cpu"


def model_path(path: str) -> str:
    """'tiny' = the embedded tiny model (built locally on first use); anything else is a HF id or folder."""
    if path == "tiny":
        from verl_agent.models.tiny import build_tiny

        return str(build_tiny())
    return path


def sampling_params(cfg: Any, validate: bool = False) -> SamplingParams:
    """Per-turn sampling from actor_rollout_ref.rollout (val_kwargs when validating; do_sample=False is greedy)."""
    r = cfg.actor_rollout_ref.rollout
    src = r.val_kwargs if validate else r
    greedy = not src.do_sample
    return SamplingParams(
        temperature=0.0 if greedy else src.temperature, top_p=src.top_p, top_k=src.top_k,
        max_new_tokens=r.response_length or cfg.data.max_response_length, seed=None if greedy else cfg.trainer.seed,
    )  # fmt: skip


def load_reward(cfg: Any) -> Any:
    """data.reward_fn, else custom_reward_function.path:name, else None (tools/interaction score)."""
    from verl_agent.reward import load_reward_fn

    if cfg.data.reward_fn:
        return load_reward_fn(cfg.data.reward_fn)
    crf = cfg.custom_reward_function
    return load_reward_fn(f"{crf.path}:{crf.name}") if crf.path else None


def build_engine(cfg: Any, model: Any = None, device: str | None = None) -> Engine:
    """The engine named by actor_rollout_ref.rollout.name; `model` (a built model) overrides model.path for hf."""
    r = cfg.actor_rollout_ref.rollout
    if r.name == "hf":
        from verl_agent.rollout.hf_engine import HFEngine

        return HFEngine(
            model if model is not None else model_path(cfg.actor_rollout_ref.model.path),
            device=device or pick_device(cfg), dtype=r.dtype, max_batch_size=r.max_batch_size,
        )  # fmt: skip
    from verl_agent.rollout.sglang_engine import SGLangEngine

    return SGLangEngine.from_config(cfg)


def build_agent_loop(cfg: Any, engine: Engine, tokenizer: Any) -> AgentLoop:
    from verl_agent.interactions.registry import load_interactions
    from verl_agent.tools import load_tools

    mt = cfg.actor_rollout_ref.rollout.multi_turn
    return AgentLoop(
        engine, tokenizer, cfg.actor_rollout_ref.rollout,
        tools=load_tools(mt.tool_config_path) if mt.enable else {},
        interactions=load_interactions(mt.interaction_config_path), reward_fn=load_reward(cfg),
        max_prompt_length=cfg.data.max_prompt_length, max_response_length=cfg.data.max_response_length,
    )  # fmt: skip


def _load_samples(cfg: Any, split: str) -> list[Sample]:
    from verl_agent.data import load_samples

    files = cfg.data.val_files if split == "val" else cfg.data.train_files
    if not files:
        raise ValueError(f"data.{split}_files is empty: give the {split} dataset (JSONL or parquet)")
    d = cfg.data
    return [
        s for f in files
        for s in load_samples(f, prompt_key=d.prompt_key, answer_key=d.answer_key, skip_bad_rows=d.skip_bad_rows)
    ]  # fmt: skip


async def evaluate(
    cfg: Any, samples: list[Sample], engine: Engine, tokenizer: Any, validate: bool = True
) -> RolloutBatch:
    """Roll out `samples` (val_kwargs.n or rollout.n per sample) in chunks of data.val_batch_size."""
    r = cfg.actor_rollout_ref.rollout
    n = r.val_kwargs.n if validate else r.n
    loop = build_agent_loop(cfg, engine, tokenizer)
    chunk = cfg.data.val_batch_size or len(samples) or 1
    trajs = []
    for i in range(0, len(samples), chunk):
        trajs += (await loop.run(samples[i : i + chunk], n, sampling_params(cfg, validate))).trajectories
    return RolloutBatch(trajectories=trajs)


def evaluate_cli(cfg: Any, split: str = "val", out: str | None = None) -> int:
    """`verl-agent rollout`: roll out a split, write trajectories, print a metrics table and one JSON line."""
    from transformers import AutoTokenizer

    samples = _load_samples(cfg, split)
    m = cfg.actor_rollout_ref.model
    tokenizer = AutoTokenizer.from_pretrained(model_path(m.tokenizer_path or m.path))
    engine = build_engine(cfg)

    async def run() -> RolloutBatch:
        try:
            return await evaluate(cfg, samples, engine, tokenizer, validate=split == "val")
        finally:
            await engine.close()

    batch = asyncio.run(run())
    path = write_records(Path(out) if out else cfg.run_dir / "rollout.jsonl", batch, tokenizer, append=False)
    metrics = summarize(batch)
    width = max(len(k) for k in metrics)
    for k, v in metrics.items():
        print(f"{k:<{width}}  {v:.4g}")
    print(f"trajectories: {path}")
    print(json.dumps({"split": split, "trajectories": str(path), **metrics}))
    return 0
