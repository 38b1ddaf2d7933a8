"""Trainer: the RL loop (`train`), Ray controller, FSDP2 workers, weight sync, checkpoints, logging, algorithms.

Heavy modules (ray, torch, transformers) load on first attribute access, so importing the pure
algorithm modules stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["TrainResult", "TrainingError", "WorkerGroup", "add_cli", "run_train_cli", "train"]

_LAZY = {
    "train": "verl_agent.trainer.loop",
    "TrainResult": "verl_agent.trainer.loop",
    "TrainingError": "verl_agent.trainer.errors",
    "add_cli": "verl_agent.trainer.loop",
    "run_train_cli": "verl_agent.trainer.loop",
    "WorkerGroup": "verl_agent.trainer.workers.controller",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'verl_agent.trainer' has no attribute {name!r}")
