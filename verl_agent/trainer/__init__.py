"""Trainer: the RL loop (`train`), Ray controller, FSDP2 workers, weight sync, checkpoints, logging, algorithms.

Heavy modules (ray, torch, transformers) load on first attribute access, so importing the pure
algorithm modules stays cheap.
"""

from __future__ import annotations

from verl_agent.imports import lazy_attributes

__all__ = ["TrainResult", "TrainingError", "WorkerGroup", "add_cli", "run_train_cli", "train"]

_LAZY = {
    "train": "verl_agent.trainer.loop",
    "TrainResult": "verl_agent.trainer.loop",
    "TrainingError": "verl_agent.trainer.errors",
    "add_cli": "verl_agent.trainer.loop",
    "run_train_cli": "verl_agent.trainer.loop",
    "WorkerGroup": "verl_agent.trainer.workers.controller",
}

__getattr__ = lazy_attributes(__name__, _LAZY)
