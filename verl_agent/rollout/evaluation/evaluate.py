"""`verl-agent rollout CONFIG [overrides]`: roll out a split, write trajectories, print metrics; and
`verl-agent eval CONFIG --k K`: pass@1, pass@k, maj@k per data_source for one or more models (`run_eval`).

Everything it runs is built by `rollout.build` from the config, exactly as the
trainer builds its workers' rollouts.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from verl_agent.config import RunConfig, save_config
from verl_agent.protocol import RolloutBatch, Sample, Trajectory
from verl_agent.rollout.build import build_reward, build_rollout, load_split, rollout_in_chunks, sampling_params
from verl_agent.rollout.metrics import summarize
from verl_agent.rollout.records import write_records
from verl_agent.tools.base import shutdown_tools

logger = logging.getLogger(__name__)

__all__ = ["EvalModel", "evaluate_cli", "format_table", "run_eval"]


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


# -- verl-agent eval -----------------------------------------------------------------------------


@dataclass
class EvalModel:
    """One model to evaluate: `label` as given; a local `model` (a path/id), or `load()` giving a built torch
    module and its tokenizer's path (called when its turn comes, so one model is in memory at a time), or an
    OpenAI-compatible `url` (with `served_name`, `api_key`)."""

    label: str
    model: Any = None
    load: Callable[[], tuple[Any, str]] | None = None
    tokenizer: str | None = None
    url: str | None = None
    served_name: str | None = None
    api_key: str = "EMPTY"


def _local_config(cfg: RunConfig, m: EvalModel) -> RunConfig:
    """The config with this model's path (and tokenizer) in actor_rollout_ref.model."""
    cfg = cfg.model_copy(deep=True)
    model_cfg = cfg.actor_rollout_ref.model
    if isinstance(m.model, (str, Path)):
        model_cfg.path = str(m.model)
    if m.tokenizer:
        model_cfg.tokenizer_path = m.tokenizer
    return cfg


async def _rollout_model(cfg: RunConfig, m: EvalModel, samples: list[Sample], n: int) -> tuple[list[Trajectory], Any]:
    """n samples per prompt from one model: (trajectories, tokenizer or None)."""
    r = cfg.actor_rollout_ref.rollout
    sampling = sampling_params(r, cfg.data, seed=cfg.trainer.seed, validate=True)
    if m.url is not None:
        from verl_agent.rollout.openai.chat_api import ChatAPILoop
        from verl_agent.tools import load_tools

        if r.agent.entrypoint or r.multi_turn.interaction_config_path:
            raise ValueError(f"--model {m.label}: an OpenAI-compatible URL runs the config's tools only; this config "
                             "has an agent.entrypoint or interactions (evaluate a local model instead)")
        tools = load_tools(r.multi_turn.tool_config_path) if r.multi_turn.enable else {}
        reward = build_reward(cfg.data, cfg.custom_reward_function, cfg.reward_model)
        loop = ChatAPILoop(m.url, m.served_name, r, tools, reward, max_response_length=cfg.data.max_response_length,
                           api_key=m.api_key, max_concurrency=r.agent.max_concurrency)
        try:
            return await rollout_in_chunks(loop, samples, n, sampling, cfg.data.val_batch_size), None
        finally:
            await shutdown_tools(tools.values())
    if m.load is not None:
        model, tokenizer = m.load()
        m = replace(m, model=model, tokenizer=tokenizer)
    local = _local_config(cfg, m)
    parts = build_rollout(local, model=None if isinstance(m.model, (str, Path)) else m.model, seed=cfg.trainer.seed)
    try:
        return await rollout_in_chunks(parts.agent, samples, n, sampling, cfg.data.val_batch_size), parts.tokenizer
    finally:
        await shutdown_tools(getattr(parts.agent, "tools", {}).values())  # the agent-function loop has none
        await parts.engine.close()


def run_eval(cfg: RunConfig, models: list[EvalModel], k: int, n: int, out_dir: Path) -> dict[str, Any]:
    """Each model on data.val_files, n samples per prompt; writes <out_dir>/result.json and one trajectory
    JSONL per model; returns the result (figures per model and data_source, see `passk`)."""
    from verl_agent.rollout.evaluation.passk import eval_figures

    if not 1 <= k <= n:
        raise ValueError(f"--k {k} needs 1 <= k <= n (samples per prompt, --n {n})")
    val = cfg.actor_rollout_ref.rollout.val_kwargs
    if n > 1 and (not val.do_sample or val.temperature == 0):
        logger.warning("actor_rollout_ref.rollout.val_kwargs samples greedily: the %d samples of a prompt will be "
                       "alike; set val_kwargs.do_sample=true val_kwargs.temperature=1.0 for pass@k", n)
    samples = load_split(cfg.data, "val")
    out_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out_dir / "config.yaml")  # what was evaluated, overrides included
    result: dict[str, Any] = {"config": str(out_dir / "config.yaml"), "k": k, "n": n, "prompts": len(samples),
                              "models": []}  # fmt: skip
    for i, m in enumerate(models):
        trajs, tokenizer = asyncio.run(_rollout_model(cfg, m, samples, n))
        path = write_records(out_dir / f"trajectories_{i}.jsonl", RolloutBatch(trajectories=trajs), tokenizer,
                             append=False)  # fmt: skip
        result["models"].append({"model": m.label, "source": "openai" if m.url else "local",
                                 "trajectories": str(path), "figures": eval_figures(trajs, k)})  # fmt: skip
    (out_dir / "result.json").write_text(json.dumps(result, indent=1))
    return result


def format_table(result: dict[str, Any]) -> str:
    """One row per data_source x figure and per outcome, one column per model."""
    models = result["models"]
    keys = list(dict.fromkeys(["prompts", "samples_scored", "pass@1", f"pass@{result['k']}", f"maj@{result['k']}",
                               "mean_reward"]))  # fmt: skip
    sources = sorted({s for m in models for s in m["figures"] if s != "all"})
    sources += ["all"] if len(sources) > 1 else []  # with one data_source, "all" would repeat its rows
    rows = [[s, key] + [_cell(m["figures"].get(s, {}).get(key)) for m in models] for s in sources for key in keys]
    outcomes = sorted({o for m in models for o in m["figures"]["all"]["outcomes"]})
    rows += [["outcomes", o] + [str(m["figures"]["all"]["outcomes"].get(o, 0)) for m in models] for o in outcomes]
    header = ["data_source", "figure"] + [m["model"] for m in models]
    widths = [max(len(str(r[c])) for r in [header, *rows]) for c in range(len(header))]
    return "\n".join("  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip() for r in [header, *rows])


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.4f}" if isinstance(v, float) else str(v)
