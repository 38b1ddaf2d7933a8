"""Rollout: the agent side. The multi-turn agent loop, the rollout stream (continuous rollouts that pause
for weight swaps), tool observations, `openai/` (the OpenAI-compatible endpoint and its recorder, and the
tool loop over someone else's Chat Completions server), `evaluation/` (`verl-agent rollout` and `eval`), and
`build`, which turns a config into all of these over an engine from `verl_agent.engine`.

Heavy modules load on first attribute access.
"""

from __future__ import annotations

from verl_agent.imports import lazy_attributes

__all__ = ["AgentLoop", "summarize"]

_LAZY = {
    "AgentLoop": "verl_agent.rollout.agent_loop",
    "summarize": "verl_agent.rollout.metrics",
}

__getattr__ = lazy_attributes(__name__, _LAZY)
