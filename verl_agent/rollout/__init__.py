"""Rollout: the `Engine` contract, the HF engine, the SGLang engine and the multi-turn agent loop.

Heavy modules (torch, transformers) load on first attribute access.
"""

from __future__ import annotations

import importlib
from typing import Any

from verl_agent.rollout.engine import Engine, EngineContractError, GenerateOutput, SamplingParams, check_engine

__all__ = [
    "AgentLoop",
    "Engine",
    "EngineContractError",
    "GenerateOutput",
    "HFEngine",
    "SGLangEngine",
    "SamplingParams",
    "check_engine",
    "summarize",
]

_LAZY = {
    "HFEngine": "verl_agent.rollout.hf_engine",
    "SGLangEngine": "verl_agent.rollout.sglang_engine",
    "AgentLoop": "verl_agent.rollout.agent_loop",
    "summarize": "verl_agent.rollout.metrics",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'verl_agent.rollout' has no attribute {name!r}")
