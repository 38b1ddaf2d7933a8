"""Training sequences and how they are cut into micro-batches: packed, no padding computed.

A `TrainSeq` is one trajectory as the trainer sees it: the full token ids
(prompt + response) and per-response-token tensors (loss mask, log-probs,
advantages, ...). Micro-batches concatenate sequences into ONE row with
position ids that restart at 0 for every sequence; transformers turns such
position ids into a block-diagonal causal mask when ``attention_mask`` is None
(``masking_utils.find_packed_sequence_indices``, sdpa/eager on CPU and GPU), so
no pad token is ever computed. tests/trainer/test_batch.py checks packed ==
padded log-probs.

Per-token tensors of a micro-batch are then laid out padded ``[B, T]`` (only
these small tensors, not the model's compute) because the loss functions in
`losses.py` take ``[B, T]`` with a response mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.nn.utils.rnn import pad_sequence

from verl_agent.protocol import Trajectory

__all__ = ["TrainSeq", "from_trajectory", "pack", "response_positions", "split_by_tokens", "split_even", "pad_field"]


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


def pack(seqs: list[TrainSeq], device: torch.device | str) -> tuple[Tensor, Tensor]:
    """One packed row: input_ids [1, L] and position_ids [1, L] restarting at 0 per sequence."""
    ids = torch.tensor([i for s in seqs for i in s.input_ids], dtype=torch.long, device=device)
    pos = torch.cat([torch.arange(s.num_tokens, device=device) for s in seqs])
    return ids[None], pos[None]


def response_positions(seqs: list[TrainSeq], device: torch.device | str) -> Tensor:
    """Rows of the packed logits that predict each response token (position t-1 predicts token t)."""
    out, offset = [], 0
    for s in seqs:
        out.append(torch.arange(offset + s.prompt_len - 1, offset + s.num_tokens - 1, device=device))
        offset += s.num_tokens
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long, device=device)


def pad_field(values: list[Tensor], device: torch.device | str | None = None) -> Tensor:
    """Right-pad per-sequence 1-D tensors to [B, T] with zeros."""
    return pad_sequence([v.to(device) if device is not None else v for v in values], batch_first=True)


def split_by_tokens(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices grouped so each group's total length <= max_tokens (first-fit decreasing).

    A sequence longer than the budget gets a group of its own (never dropped).
    Groups are returned in a deterministic order.
    """
    if max_tokens < 1:
        raise ValueError(f"ppo_max_token_len_per_gpu must be >= 1, got {max_tokens}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        for b, load in enumerate(loads):
            if load + lengths[i] <= max_tokens:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return bins


def split_even(lengths: list[int], k: int) -> list[list[int]]:
    """Indices into exactly k groups balancing total length (some may be empty when k > len)."""
    bins: list[list[int]] = [[] for _ in range(k)]
    loads = [0] * k
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        b = min(range(k), key=lambda j: (loads[j], j))
        bins[b].append(i)
        loads[b] += lengths[i]
    return bins
