"""`summarize(batch)`: the rollout metrics the trainer logs and `verl-agent rollout` prints.

A trajectory counts as a success when its reward is at least `success_threshold`
(1.0 by default: the usual "correct answer" score; pass 0.5 or so for partial credit).
"""

from __future__ import annotations

import statistics
from collections import Counter

from verl_agent.protocol import RolloutBatch

__all__ = ["summarize"]


def _stats(prefix: str, values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {
        f"{prefix}/mean": statistics.fmean(values),
        f"{prefix}/std": statistics.pstdev(values) if len(values) > 1 else 0.0,
        f"{prefix}/min": min(values),
        f"{prefix}/max": max(values),
    }


def summarize(batch: RolloutBatch, success_threshold: float = 1.0) -> dict[str, float]:
    """Flat name -> number metrics: success rate, reward stats, turns, tool calls/errors, lengths, stop reasons."""
    trajs = batch.trajectories
    n = len(trajs)
    if n == 0:
        return {"rollout/num_trajectories": 0.0}
    m = lambda t, k: float(t.metrics.get(k, 0.0))  # noqa: E731
    calls = sum(m(t, "num_tool_calls") for t in trajs)
    out: dict[str, float] = {
        "rollout/num_trajectories": float(n),
        "rollout/success_rate": sum(t.reward >= success_threshold for t in trajs) / n,
        "rollout/error_rate": sum(t.error is not None for t in trajs) / n,
        "rollout/tool_calls_total": calls,
        "rollout/tool_error_rate": sum(m(t, "num_tool_errors") for t in trajs) / max(1.0, calls),
        "rollout/model_tokens_total": float(sum(t.num_model_tokens for t in trajs)),
    }
    out.update(_stats("rollout/reward", [t.reward for t in trajs]))
    out.update(_stats("rollout/num_turns", [float(len(t.turns)) for t in trajs]))
    out.update(_stats("rollout/num_tool_calls", [m(t, "num_tool_calls") for t in trajs]))
    out.update(_stats("rollout/response_length", [float(len(t.response_ids)) for t in trajs]))
    out.update(_stats("rollout/prompt_length", [float(len(t.prompt_ids)) for t in trajs]))
    out.update(_stats("rollout/seconds", [m(t, "seconds") for t in trajs]))
    for reason, count in Counter(t.stop_reason for t in trajs).items():
        out[f"rollout/stop/{reason}"] = count / n
    return out
