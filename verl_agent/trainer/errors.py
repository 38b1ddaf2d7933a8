"""Why a training run stops: the errors the RL loop raises (each message names the cause)."""

from __future__ import annotations

__all__ = ["CheckpointWriteError", "InfraFailureError", "TrainingError"]


class TrainingError(RuntimeError):
    """The run stopped; the message says at which step, why, and which checkpoint is intact."""


class InfraFailureError(RuntimeError):
    """Too many of a step's trajectories failed for infrastructure reasons (trainer.max_infra_failure_fraction)."""


class CheckpointWriteError(RuntimeError):
    """Writing a checkpoint failed (a worker died, a full disk, ...); the partial one was removed."""
