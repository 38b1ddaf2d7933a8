"""GSM8K answer extraction and scoring with verl's semantics (verl.utils.reward_score.gsm8k).

Two extraction methods, both on the last 300 characters of the text (the answer is at the end, and a
regex over a long text is slow):

* ``strict``: the last ``#### <number>``; commas and dollar signs removed. Tests the format too.
* ``flexible``: the last number-like run of digits, '.', ',' and '-' that is not just "."; kept as
  written (so "1,000" does not match a ground truth "1000", as in verl).

The score is ``score`` when the extracted answer equals ``str(ground_truth)`` exactly, ``format_score``
when an answer was found but differs, and 0 when none was found. `compute_score` has verl's reward
signature, so ``data.reward_fn=verl_agent.gsm8k.compute_score`` scores rows of verl's GSM8K parquet
the way verl's default scorer does for ``data_source: openai/gsm8k``.
"""

from __future__ import annotations

import re
from typing import Any, Literal

__all__ = ["compute_score", "extract_solution", "gsm8k_score"]

_CLIP = 300
_STRICT = re.compile(r"#### (\-?[0-9\.\,]+)")
_FLEXIBLE = re.compile(r"(\-?[0-9\.\,]+)")


def extract_solution(text: str, method: Literal["strict", "flexible"] = "strict") -> str | None:
    """The final answer in `text` by `method`, or None when there is none."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"method must be 'strict' or 'flexible', got {method!r}")
    text = text[-_CLIP:]
    if method == "strict":
        found = _STRICT.findall(text)
        return found[-1].replace(",", "").replace("$", "") if found else None
    for candidate in reversed(_FLEXIBLE.findall(text)):
        if candidate not in ("", "."):
            return candidate
    return None


def gsm8k_score(text: str, ground_truth: Any, method: Literal["strict", "flexible"] = "strict",
                format_score: float = 0.0, score: float = 1.0) -> float:
    """`score` for a correct answer, `format_score` for a wrong one, 0 when no answer is found."""
    answer = extract_solution(text or "", method)
    if answer is None:
        return 0
    return score if answer == str(ground_truth) else format_score


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """verl's reward signature; strict GSM8K scoring (verl's default for data_source openai/gsm8k)."""
    return float(gsm8k_score(solution_str, ground_truth, method="strict"))
