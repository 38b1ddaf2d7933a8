"""`summarize(trajectories)`: the rollout metrics the trainer logs and `verl-agent rollout` prints.

A trajectory counts as a success when its reward is at least `SUCCESS_THRESHOLD`
(1.0: the usual "correct answer" score). Metrics read only a few scalars of each
trajectory (`TrajectorySummary`), so the trainer's workers send summaries, not
trajectories, to the driver.

Namespaced trajectory metrics (a "/" in the name, e.g. `proxy/history_rewrites`) are summed
over the batch as `rollout/<name>`.

Episodes and segments: an episode whose context was rewritten (or an agent run that rewrote its history)
is several trajectories, its segments (`metrics["segment"]` of `metrics["num_segments"]`). Success, reward,
outcomes and stop reasons are per episode (read from its last segment: all its segments share its reward
and outcome); lengths, turns and token counts are per trajectory, as trained.

Scored trajectories: success, reward and the per-trajectory distributions (turns, tool calls, lengths) count
only what the loss sees, the outcomes `ok` and `policy_failure` (`rollout/num_scored` episodes). An
infrastructure failure or a filtered prompt has no reward of its own (its 0.0 is a placeholder), so counting it
would pull the curve down by the failure rate. Totals of work done (tool calls, model tokens, seconds, namespaced
sums) and the stop-reason shares count every trajectory.

Outcomes: `rollout/infra_failed` is the share of infrastructure failures and
`rollout/infra_failed/<cause>` their count per cause; `rollout/policy_failed/<cause>`
counts the model's own failures; `rollout/filtered` counts prompts dropped as overlong.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from verl_agent.protocol import SCORED_OUTCOMES, SUCCESS_THRESHOLD, RolloutBatch, Trajectory

__all__ = ["TrajectorySummary", "summarize"]


@dataclass(frozen=True)
class TrajectorySummary:
    """The scalars of one trajectory that metrics need (a few hundred bytes, not its tokens)."""

    uid: str
    reward: float
    outcome: str
    cause: str | None
    error: str | None
    stop_reason: str
    num_turns: int
    num_tool_calls: float
    num_tool_errors: float
    response_length: int
    prompt_length: int
    model_tokens: int
    seconds: float
    oldest_version: int = 0
    turns_cut: int = 0  # turns whose tokens span a weight update (partial rollout at a token boundary)
    last_segment: bool = True  # the episode's last (or only) segment: it counts the episode
    extra: dict[str, float] = field(default_factory=dict)  # namespaced per-trajectory metrics, e.g. proxy/*, agent/*

    @classmethod
    def of(cls, t: Trajectory) -> TrajectorySummary:
        m = t.metrics
        return cls(uid=t.uid, reward=float(t.reward), outcome=t.outcome, cause=t.cause,
                   error=t.error[:500] if t.error else None, stop_reason=t.stop_reason, num_turns=len(t.turns),
                   num_tool_calls=float(m.get("num_tool_calls", 0.0)),
                   num_tool_errors=float(m.get("num_tool_errors", 0.0)), response_length=len(t.response_ids),
                   prompt_length=len(t.prompt_ids), model_tokens=t.num_model_tokens,
                   seconds=float(m.get("seconds", 0.0)), oldest_version=t.oldest_version,
                   turns_cut=sum(turn.token_versions is not None for turn in t.turns),
                   last_segment=m.get("segment", 0.0) >= m.get("num_segments", 1.0) - 1,
                   extra={k: float(v) for k, v in m.items() if "/" in k and isinstance(v, (int, float))})  # fmt: skip


def _stats(prefix: str, values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {
        f"{prefix}/mean": statistics.fmean(values),
        f"{prefix}/std": statistics.pstdev(values) if len(values) > 1 else 0.0,
        f"{prefix}/min": min(values),
        f"{prefix}/max": max(values),
    }


def summarize(trajectories: RolloutBatch | Iterable[Trajectory | TrajectorySummary]) -> dict[str, float]:
    """Flat name -> number metrics: success rate, reward stats, outcomes, turns, tool calls, lengths, stops."""
    items = trajectories.trajectories if isinstance(trajectories, RolloutBatch) else trajectories
    trajs = [t if isinstance(t, TrajectorySummary) else TrajectorySummary.of(t) for t in items]
    if not trajs:
        return {"rollout/num_trajectories": 0.0}
    out = _episode_metrics([t for t in trajs if t.last_segment])
    out.update(_trajectory_metrics(trajs))
    return out


def _episode_metrics(episodes: list[TrajectorySummary]) -> dict[str, float]:
    n = max(1, len(episodes))
    outcomes = Counter(t.outcome for t in episodes)
    scored = [t for t in episodes if t.outcome in SCORED_OUTCOMES]
    out: dict[str, float] = {
        "rollout/num_episodes": float(len(episodes)),
        "rollout/num_scored": float(len(scored)),
        "rollout/infra_failed": outcomes["infra_failure"] / n,
        "rollout/filtered": float(outcomes["filtered"]),
    }
    if scored:  # no success rate at all rather than a 0.0 made of failures
        out["rollout/success_rate"] = sum(t.reward >= SUCCESS_THRESHOLD for t in scored) / len(scored)
    for (outcome, cause), count in Counter((t.outcome, t.cause) for t in episodes if t.cause).items():
        if outcome in ("infra_failure", "policy_failure"):
            out[f"rollout/{outcome.replace('_failure', '_failed')}/{cause}"] = float(count)
    out.update(_stats("rollout/reward", [t.reward for t in scored]))
    for reason, count in Counter(t.stop_reason for t in episodes).items():
        out[f"rollout/stop/{reason}"] = count / n
    return out


def _trajectory_metrics(trajs: list[TrajectorySummary]) -> dict[str, float]:
    calls = sum(t.num_tool_calls for t in trajs)
    scored = [t for t in trajs if t.outcome in SCORED_OUTCOMES]
    out: dict[str, float] = {
        "rollout/num_trajectories": float(len(trajs)),
        "rollout/tool_calls_total": calls,
        "rollout/tool_errors_per_call": sum(t.num_tool_errors for t in trajs) / max(1.0, calls),
        "rollout/model_tokens_total": float(sum(t.model_tokens for t in trajs)),
        "rollout/turns_cut_by_update": float(sum(t.turns_cut for t in trajs)),
    }
    out.update(_stats("rollout/num_turns", [float(t.num_turns) for t in scored]))
    out.update(_stats("rollout/num_tool_calls", [t.num_tool_calls for t in scored]))
    out.update(_stats("rollout/response_length", [float(t.response_length) for t in scored]))
    out.update(_stats("rollout/prompt_length", [float(t.prompt_length) for t in scored]))
    out.update(_stats("rollout/seconds", [t.seconds for t in trajs]))
    for key in sorted({k for t in trajs for k in t.extra}):  # e.g. proxy/history_rewrites: totals over the batch
        out[f"rollout/{key}"] = sum(t.extra.get(key, 0.0) for t in trajs)
    return out
