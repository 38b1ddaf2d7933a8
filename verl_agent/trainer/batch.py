"""Training sequences: one trajectory as the trainer sees it.

A `TrainSeq` holds the full token ids (prompt + response, exactly as the engine produced them)
and per-response-token tensors (loss mask, log-probs, advantages, ...). `actor.py` cuts them
into micro-batches of similar lengths and lays per-token fields out padded ``[B, T]`` with
`pad_field`, because the loss functions in `losses.py` take ``[B, T]`` with a response mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from verl_agent.protocol import Trajectory

__all__ = ["TrainSeq", "from_trajectory", "pad_field"]


@dataclass
class TrainSeq:
    """One trajectory for training; every per-token field has length ``response_len``."""

    input_ids: list[int]
    prompt_len: int
    loss_mask: Tensor  # [R] 1 on model tokens
    uid: str = ""
    score: float = 0.0
    rollout_log_probs: Tensor | None = None
    old_log_probs: Tensor | None = None
    ref_log_probs: Tensor | None = None
    old_values: Tensor | None = None
    advantages: Tensor | None = None
    returns: Tensor | None = None
    extra: dict = field(default_factory=dict)

    @property
    def response_len(self) -> int:
        return len(self.input_ids) - self.prompt_len

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


def from_trajectory(t: Trajectory) -> TrainSeq:
    """Trajectory -> TrainSeq; the ids are used exactly as the engine produced them."""
    if not t.prompt_ids:
        raise ValueError(f"trajectory {t.uid}: empty prompt_ids")
    return TrainSeq(
        input_ids=list(t.prompt_ids) + list(t.response_ids), prompt_len=len(t.prompt_ids),
        loss_mask=torch.tensor(t.loss_mask, dtype=torch.float32), uid=t.uid, score=float(t.reward),
        rollout_log_probs=torch.tensor(t.rollout_logprobs, dtype=torch.float32),
    )  # fmt: skip


def pad_field(values: list[Tensor], device: torch.device | str | None = None) -> Tensor:
    """Right-pad per-sequence 1-D tensors to [B, T] with zeros."""
    return pad_sequence([v.to(device) if device is not None else v for v in values], batch_first=True)
