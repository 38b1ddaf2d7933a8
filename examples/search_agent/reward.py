"""Exact-match reward on the text inside the last <answer>...</answer> (Search-R1's rule).

verl's signature: compute_score(data_source, solution_str, ground_truth, extra_info) -> float.
`ground_truth` is one answer or a list of accepted answers.
"""

from __future__ import annotations

import re
import string
from typing import Any

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)


def normalize(text: str) -> str:
    text = text.lower()
    text = "".join(c for c in text if c not in string.punctuation)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    found = _ANSWER.findall(solution_str or "")
    if not found:
        return 0.0
    accepted = ground_truth if isinstance(ground_truth, list) else [ground_truth]
    return 1.0 if normalize(found[-1]) in {normalize(str(a)) for a in accepted} else 0.0
