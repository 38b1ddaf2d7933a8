"""Which trajectories of a file a page shows: filters over record heads (cheap) and details (on demand).

The same rules are implemented in static/api.js for the self-contained HTML report; keep them in step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from verl_agent.viewer.jsonl import JsonlIndex

__all__ = ["TRUNCATED_STOPS", "Filter", "facets", "select"]

# Stop reasons that cut an episode short (Gymnasium's "truncated", as opposed to terminated).
TRUNCATED_STOPS = frozenset({"response_budget", "engine_length", "max_assistant_turns", "max_user_turns",
                             "max_tokens_per_turn", "max_total_tokens", "max_context_length"})


@dataclass
class Filter:
    """status: ok | policy_failure | infra_failure | filtered | truncated | error (unreadable lines)."""

    status: str | None = None
    cause: str | None = None
    min_reward: float | None = None
    max_reward: float | None = None
    tool: str | None = None
    text: str | None = None
    uid: str | None = None

    @property
    def needs_details(self) -> bool:
        return bool(self.tool or self.text)

    def match_head(self, head: dict[str, Any], error: str | None) -> bool:
        if self.status == "error":
            return error is not None
        if error is not None:
            return self.status is None and not (self.cause or self.uid or self.needs_details)
        if self.status == "truncated":
            if head.get("stop_reason") not in TRUNCATED_STOPS:
                return False
        elif self.status and head.get("outcome", "ok") != self.status:
            return False
        if self.cause and head.get("cause") != self.cause:
            return False
        if self.uid is not None and head.get("uid") != self.uid:
            return False
        reward = head.get("reward")
        reward = float(reward) if isinstance(reward, (int, float)) else 0.0
        if self.min_reward is not None and reward < self.min_reward:
            return False
        return self.max_reward is None or reward <= self.max_reward

    def match_details(self, details: dict[str, Any]) -> bool:
        if self.tool and self.tool not in details.get("tools", ()):
            return False
        return not self.text or self.text.lower() in details.get("text", "")


def select(index: JsonlIndex, flt: Filter) -> list[int]:
    """Indices of the matching entries, in file order."""
    out = [i for i, e in enumerate(index.entries) if flt.match_head(e.head, e.error)]
    if flt.needs_details:
        out = [i for i in out if flt.match_details(index.details(i))]
    return out


def facets(index: JsonlIndex, with_tools: bool = False) -> dict[str, Any]:
    """Counts per status and cause (and tool names, which need every record's details)."""
    status: dict[str, int] = {}
    causes: dict[str, int] = {}
    for e in index.entries:
        if e.error is not None:
            status["error"] = status.get("error", 0) + 1
            continue
        key = e.head.get("outcome", "ok")
        status[key] = status.get(key, 0) + 1
        if e.head.get("stop_reason") in TRUNCATED_STOPS:
            status["truncated"] = status.get("truncated", 0) + 1
        if e.head.get("cause"):
            causes[e.head["cause"]] = causes.get(e.head["cause"], 0) + 1
    out: dict[str, Any] = {"status": status, "causes": causes}
    if with_tools:
        tools: dict[str, int] = {}
        for i in range(len(index)):
            for t in index.details(i).get("tools", ()):
                tools[t] = tools.get(t, 0) + 1
        out["tools"] = tools
    return out


def summary(index: JsonlIndex, i: int) -> dict[str, Any]:
    """One row of the step browser."""
    e = index.entries[i]
    row: dict[str, Any] = {"index": i, "line": e.lineno, "error": e.error}
    if e.error is None:
        d = index.details(i)
        row.update({k: e.head.get(k) for k in ("uid", "reward", "outcome", "cause", "stop_reason", "policy_version")})
        row.update(tools=d.get("tools", []), num_turns=d.get("num_turns", 0), prompt=d.get("prompt", ""))
        if d.get("error"):
            row["error"] = d["error"]
    return row
