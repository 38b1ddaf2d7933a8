"""Reward: run the final answer's code against the task's test cases in the sandbox; score = pass rate.

verl's signature: compute_score(data_source, solution_str, ground_truth, extra_info) -> float.
`solution_str` is the last assistant message; its last ```python block is the solution.
`ground_truth` is the list of test cases (or that list as a JSON string, as parquet files store it):
{"fn_name": "add", "args": [1, 2], "expected": 3} calls a function; {"input": ..., "output": ...} uses stdin/stdout.
The sandbox URL is $SANDBOX_FUSION_URL (default: where `verl-agent sandbox up` serves, sandbox.api.DEFAULT_URL).
A sandbox that is down or fails raises (SandboxUnavailable) instead of scoring 0.0: the reward path reports
the sample as a reward error (an infrastructure failure), never as the model's score.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

from verl_agent.sandbox.api import DEFAULT_URL
from verl_agent.sandbox.code_reward import score_code


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    cases = json.loads(ground_truth) if isinstance(ground_truth, str) else list(ground_truth or [])
    url = os.environ.get("SANDBOX_FUSION_URL", DEFAULT_URL)
    # The agent loop calls reward functions in a worker thread, so a private event loop is fine here.
    # No try/except: an unreachable or broken sandbox must surface as an error, not as a 0.0 reward.
    result = asyncio.run(score_code(solution_str or "", cases, url=url, timeout=10.0))
    return result.score
