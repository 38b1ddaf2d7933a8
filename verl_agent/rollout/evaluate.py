"""`verl-agent rollout CONFIG [overrides]`: roll out a split, write trajectories, print metrics.

Everything it runs is built by `rollout.build` from the config, exactly as the
trainer builds its workers' rollouts.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

from verl_agent.config import RunConfig
from verl_agent.protocol import RolloutBatch
from verl_agent.rollout.build import build_rollout, load_split, rollout_in_chunks, sampling_params
from verl_agent.rollout.metrics import summarize
from verl_agent.rollout.records import write_records

logger = logging.getLogger(__name__)

__all__ = ["evaluate_cli"]


def evaluate_cli(cfg: RunConfig, split: str = "val", out: str | None = None) -> int:
    """Roll out data.{split}_files (val_kwargs for val), write trajectories, print a metrics table and a JSON line."""
    samples = load_split(cfg.data, split)
    parts = build_rollout(cfg, seed=cfg.trainer.seed)
    validate = split == "val"
    r = cfg.actor_rollout_ref.rollout
    n = r.val_kwargs.n if validate else r.n
    sampling = sampling_params(r, cfg.data, seed=cfg.trainer.seed, validate=validate)

    async def run() -> RolloutBatch:
        try:
            trajs = await rollout_in_chunks(parts.agent, samples, n, sampling, cfg.data.val_batch_size)
            return RolloutBatch(trajectories=trajs)
        finally:
            await parts.engine.close()

    batch = asyncio.run(run())
    path = write_records(Path(out) if out else cfg.run_dir / "rollout.jsonl", batch, parts.tokenizer, append=False)
    metrics = summarize(batch)
    width = max(len(k) for k in metrics)
    for k, v in metrics.items():
        print(f"{k:<{width}}  {v:.4g}")
    print(f"trajectories: {path}")
    print(json.dumps({"split": split, "trajectories": str(path), **metrics}))
    return 0
