"""Training sequences: one trajectory as the trainer sees it.

A `TrainSeq` holds the full token ids (prompt + response, exactly as the engine produced them)
and per-response-token tensors (loss mask, log-probs, advantages, ...), plus the assistant turns
(boundaries, scores, anchor states) that the turn-level estimators read. `actor.py` cuts them
into micro-batches of similar lengths and lays per-token fields out padded ``[B, T]`` with
`pad_field`, because the loss functions in `losses.py` take ``[B, T]`` with a response mask.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from verl_agent.protocol import Trajectory

__all__ = ["TrainSeq", "from_trajectory", "pad_field", "anchor_keys"]


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
    turns: list[tuple[int, int]] = field(default_factory=list)  # (gen_start, gen_end) per assistant turn
    turn_scores: list[float] = field(default_factory=list)  # Turn.score per turn
    turn_keys: list[Hashable] = field(default_factory=list)  # anchor state each turn starts from (gigpo)
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
        turns=[(x.gen_start, x.gen_end) for x in t.turns], turn_scores=[float(x.score) for x in t.turns],
        turn_keys=anchor_keys(t),
    )  # fmt: skip


def anchor_keys(t: Trajectory) -> list[Hashable]:
    """The state each turn starts from (GiGPO's anchor): the interaction's ``state_key`` when it gave
    one, else the token ids of the observation just before the turn (the prompt for the first turn)."""
    keys: list[Hashable] = []
    for k, turn in enumerate(t.turns):
        if turn.state_key is not None:
            keys.append(("state", turn.state_key))
        elif k == 0:
            keys.append(("obs", *t.prompt_ids))
        else:
            prev = t.turns[k - 1]
            keys.append(("obs", *t.response_ids[prev.gen_end : prev.obs_end]))
    return keys


def pad_field(values: list[Tensor], device: torch.device | str | None = None) -> Tensor:
    """Right-pad per-sequence 1-D tensors to [B, T] with zeros."""
    return pad_sequence([v.to(device) if device is not None else v for v in values], batch_first=True)
