"""Evaluation figures over n samples per prompt: pass@1, pass@k, maj@k, mean reward, outcome counts.

pass@k is the unbiased estimator of Chen et al. (2021), "Evaluating Large Language Models Trained on
Code": for a prompt with n samples of which c succeed, 1 - C(n-c, k) / C(n, k), averaged over prompts.
A sample succeeds when its reward is at least `SUCCESS_THRESHOLD` (as in the training metrics).

Exclusions: infrastructure failures (tool_timeout, sandbox_unavailable, reward_error, ...) and filtered
prompts are no answer of the model's, so they are left out of n (neither success nor failure) and
counted by cause. A prompt with fewer than k samples left is left out of pass@k and maj@k (counted in
`prompts_short`); one with none left is left out of everything (`prompts_excluded`).

maj@k: the answers of a prompt's first k samples vote (`extract_answer`: a ``\\boxed{...}``, else the text
after ``####``, else the last number, of the final reply); the prompt counts as solved when a sample
giving the most common answer (ties: the earliest) succeeded. A sample with no answer does not vote; a
prompt with no vote counts as unsolved. Reported only when some answer could be extracted.
"""

from __future__ import annotations

import math
import re
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable
from typing import Any

from verl_agent.protocol import SUCCESS_THRESHOLD, Trajectory

__all__ = ["EXCLUDED", "eval_figures", "extract_answer", "majority_solved", "outcome_counts", "pass_at_k"]

EXCLUDED = ("infra_failure", "filtered")  # outcomes that are not the model's answer
_BOXED = re.compile(r"\\boxed\{([^{}]*(?:\{[^{}]*\}[^{}]*)*)\}")
_HASHES = re.compile(r"####\s*([^\n]+)")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al.'s unbiased pass@k for one prompt: n samples, c correct; needs 0 <= c <= n and 1 <= k <= n."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _number(text: str) -> str:
    """'1,234.50' -> '1234.5', so that one value has one spelling."""
    try:
        value = float(text.replace(",", ""))
    except ValueError:
        return text.strip()
    return str(int(value)) if value.is_integer() else repr(value)


def extract_answer(text: str | None) -> str | None:
    """The final answer of a reply: \\boxed{...}, else after '####', else the last number; None if none."""
    if not text:
        return None
    for pattern in (_BOXED, _HASHES):
        found = pattern.findall(text)
        if found:
            inner = found[-1].strip()
            numbers = _NUMBER.findall(inner)
            return _number(numbers[-1]) if numbers and _NUMBER.fullmatch(inner.replace(" ", "")) else inner
    numbers = _NUMBER.findall(text)
    return _number(numbers[-1]) if numbers else None


def majority_solved(votes: list[tuple[str | None, bool]]) -> bool:
    """votes: (answer, success) of a prompt's samples, in order; is the most common answer a correct one?"""
    counted = Counter(answer for answer, _ in votes if answer is not None)
    if not counted:
        return False
    top = max(counted.values())
    winner = next(answer for answer, _ in votes if answer is not None and counted[answer] == top)
    return any(ok for answer, ok in votes if answer == winner)


def _final_reply(traj: Trajectory) -> str:
    return next((m.content for m in reversed(traj.messages) if m.role == "assistant"), "")


def outcome_counts(trajs: Iterable[Trajectory]) -> dict[str, int]:
    """{"ok": 5, "policy_failure/wrong_answer": 3, "infra_failure/tool_timeout": 1, ...}."""
    counts = Counter(t.outcome + (f"/{t.cause}" if t.cause else "") for t in trajs)
    return dict(sorted(counts.items()))


def _figures(groups: list[list[Trajectory]], k: int) -> dict[str, Any]:
    """The figures of one set of prompts (each a list of its samples)."""
    kept = [[t for t in g if t.outcome not in EXCLUDED] for g in groups]
    scored = [g for g in kept if g]
    full = [g for g in scored if len(g) >= k]
    success = [[t.reward >= SUCCESS_THRESHOLD for t in g] for g in scored]
    out: dict[str, Any] = {
        "prompts": len(groups), "prompts_excluded": len(groups) - len(scored), "prompts_short": len(scored) - len(full),
        "samples": sum(len(g) for g in groups), "samples_scored": sum(len(g) for g in scored),
        "pass@1": statistics.fmean(sum(s) / len(s) for s in success) if success else None,
        f"pass@{k}": statistics.fmean(pass_at_k(len(g), sum(t.reward >= SUCCESS_THRESHOLD for t in g), k)
                                      for g in full) if full else None,
        "mean_reward": statistics.fmean(t.reward for g in scored for t in g) if scored else None,
    }  # fmt: skip
    votes = [[(extract_answer(_final_reply(t)), t.reward >= SUCCESS_THRESHOLD) for t in g[:k]] for g in full]
    if any(answer is not None for v in votes for answer, _ in v):
        out[f"maj@{k}"] = statistics.fmean(majority_solved(v) for v in votes)
    else:
        out[f"maj@{k}"] = None  # no reply had an answer to vote with
    out["outcomes"] = outcome_counts(t for g in groups for t in g)
    return out


def eval_figures(trajs: list[Trajectory], k: int) -> dict[str, dict[str, Any]]:
    """{"all": figures, <data_source>: figures, ...}; the samples of a prompt share its uid (in order)."""
    by_uid: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajs:  # an agent run cut in segments (agent.entrypoint) is one sample: its last segment
        if t.metrics.get("segment", 0.0) == t.metrics.get("num_segments", 1.0) - 1:
            by_uid[t.uid].append(t)
    groups = list(by_uid.values())
    out = {"all": _figures(groups, k)}
    for source in sorted({g[0].data_source for g in groups}):
        out[source] = _figures([g for g in groups if g[0].data_source == source], k)
    return out
