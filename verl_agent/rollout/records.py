"""Trajectory records: one JSON object per line, readable by humans and by `verl-agent view`.

A record holds the messages, the decoded prompt/response text, the token ids,
loss mask and rollout log-probs, the rewards with per-turn boundaries and
scores, turn timings, stop reason and metrics. Training records also carry ``advantages``: the
advantage of every response token (aligned with ``response_ids``, 0.0 off the loss mask, rounded
to 4 decimals) as the loss used it; trajectories left out of the loss have none.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from verl_agent.protocol import RolloutBatch, Trajectory

__all__ = ["trajectory_record", "write_records", "read_records", "print_records"]


def trajectory_record(traj: Trajectory, tokenizer: Any = None, step: int | None = None,
                      advantages: Sequence[float] | None = None) -> dict[str, Any]:  # fmt: skip
    """A JSON-ready dict of one trajectory (texts decoded with `tokenizer` when given)."""
    rec: dict[str, Any] = {
        "uid": traj.uid,
        "step": step,
        "policy_version": traj.policy_version,
        "data_source": traj.data_source,
        "reward": traj.reward,
        "stop_reason": traj.stop_reason,
        "outcome": traj.outcome,
        "cause": traj.cause,
        "error": traj.error,
        "messages": [m.to_chat() for m in traj.messages],
        "turns": [asdict(t) for t in traj.turns],
        "metrics": traj.metrics,
    }
    if tokenizer is not None:
        rec["prompt_text"] = tokenizer.decode(traj.prompt_ids)
        rec["response_text"] = tokenizer.decode(traj.response_ids)
    rec.update(prompt_ids=traj.prompt_ids, response_ids=traj.response_ids, loss_mask=traj.loss_mask,
               rollout_logprobs=[round(x, 5) for x in traj.rollout_logprobs])  # fmt: skip
    if advantages is not None:
        if len(advantages) != len(traj.response_ids):
            raise ValueError(f"trajectory {traj.uid}: {len(advantages)} advantages for "
                             f"{len(traj.response_ids)} response tokens")
        rec["advantages"] = [round(float(a), 4) if m else 0.0 for a, m in zip(advantages, traj.loss_mask)]
    return rec


def write_records(path: str | Path, batch: RolloutBatch, tokenizer: Any = None, step: int | None = None,
                  append: bool = True, advantages: Sequence[Sequence[float] | None] | None = None) -> Path:  # fmt: skip
    """Append (or write) one line per trajectory; returns the path.

    ``advantages``: per trajectory, its per-token advantages or None (see `trajectory_record`).

    The lines are written in one locked write, so several processes (the trainer's workers)
    may append to the same file without interleaving.
    """
    import fcntl

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    advs = advantages if advantages is not None else [None] * len(batch.trajectories)
    text = "".join(json.dumps(trajectory_record(t, tokenizer, step, a), ensure_ascii=False) + "\n"
                   for t, a in zip(batch.trajectories, advs, strict=True))  # fmt: skip
    with path.open("a" if append else "w", encoding="utf-8") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            f.write(text)
            f.flush()
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
    return path


def read_records(path: str | Path) -> Iterator[dict[str, Any]]:
    """Records of a JSONL file; ValueError names the file and line of a record that is not one."""
    with Path(path).open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not a JSON record: {e}") from None
                if not isinstance(rec, dict) or "uid" not in rec or "messages" not in rec:
                    raise ValueError(f"{path}:{lineno}: not a trajectory record (needs 'uid' and 'messages')")
                yield rec


def format_record(rec: dict[str, Any]) -> str:
    """A few readable lines: header, then one line per message."""
    outcome = rec.get("outcome", "ok") + (f"/{rec['cause']}" if rec.get("cause") else "")
    lines = [
        f"== {rec['uid']}  reward={rec.get('reward', 0.0):.3f}  {outcome}  stop={rec.get('stop_reason')}  "
        f"turns={len(rec.get('turns', []))}" + (f"  error={rec['error']}" if rec.get("error") else "")
    ]
    for m in rec.get("messages", []):
        text = m.get("content") or ""
        for c in m.get("tool_calls") or []:
            fn = c.get("function", {})
            text += f" [call {fn.get('name')}({json.dumps(fn.get('arguments'), ensure_ascii=False)})]"
        lines.append(f"  {m['role']:>9}: {text.strip()}")
    return "\n".join(lines)


def print_records(path: str | Path, limit: int = 5, only_failed: bool = False) -> int:
    """Print up to `limit` records (only reward <= 0 with only_failed); returns how many were printed."""
    shown = 0
    for rec in read_records(path):
        if only_failed and rec.get("reward", 0.0) > 0:
            continue
        if shown >= limit:
            break
        print(format_record(rec))
        shown += 1
    return shown
