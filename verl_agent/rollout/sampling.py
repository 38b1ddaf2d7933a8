"""Batched sampling with per-row settings: one decode step's logits -> (token, log-prob) per row.

Log-probs are those of the sampling distribution after temperature and BEFORE
top-k/top-p filtering: ``log_softmax(logits / temperature)`` (``log_softmax(logits)``
for greedy rows). The trainer recomputes old log-probs with the actor; rollout
log-probs serve as a check of engine/actor agreement, and this choice makes
them comparable with the actor's full-vocabulary log-probs at the same
temperature.

Sampling uses the exponential-race trick (``argmax(p / E)`` with ``E ~ Exp(1)``),
which equals a categorical draw and lets each seeded row draw its noise from its
own generator: the same seed gives the same sample whatever the batch around it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from verl_agent.rollout.engine import SamplingParams


@dataclass
class RowParams:
    """Per-row sampling settings as tensors on the decode device."""

    temperature: torch.Tensor  # [B] float, 0 = greedy
    top_p: torch.Tensor  # [B] float
    top_k: torch.Tensor  # [B] long, <= 0 = off
    generators: list[torch.Generator | None]  # per-row generator for seeded rows
    any_filter: bool
    any_greedy: bool
    all_greedy: bool

    @classmethod
    def build(cls, params: Sequence[SamplingParams], device: torch.device) -> RowParams:
        temps = [p.temperature for p in params]
        gens: list[torch.Generator | None] = []
        for p in params:
            g = None
            if p.seed is not None and p.temperature > 0:
                g = torch.Generator(device=device)
                g.manual_seed(int(p.seed))
            gens.append(g)
        return cls(
            temperature=torch.tensor(temps, dtype=torch.float32, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.long, device=device),
            generators=gens,
            any_filter=any((p.top_k > 0 or p.top_p < 1.0) and p.temperature > 0 for p in params),
            any_greedy=any(t == 0 for t in temps),
            all_greedy=all(t == 0 for t in temps),
        )


    def select(self, keep: torch.Tensor) -> RowParams:
        """The rows at `keep` (the batch shrinks when requests finish)."""
        temp, top_p, top_k = self.temperature[keep], self.top_p[keep], self.top_k[keep]
        sampled = temp > 0
        return RowParams(
            temperature=temp, top_p=top_p, top_k=top_k, generators=[self.generators[i] for i in keep.tolist()],
            any_filter=bool((((top_k > 0) | (top_p < 1.0)) & sampled).any()),
            any_greedy=bool((~sampled).any()), all_greedy=bool((~sampled).all()),
        )  # fmt: skip


def filter_top_k_top_p(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set logits outside each row's top-k / nucleus to -inf (the top token always survives)."""
    vocab = scaled.shape[-1]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=scaled.device).expand_as(sorted_logits)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    drop = rank >= k[:, None]
    probs = sorted_logits.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly above this token
    drop |= before >= top_p[:, None]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(scaled).scatter_(-1, order, sorted_logits)


def sample(
    logits: torch.Tensor, rows: RowParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row from float logits [B, V]; returns (tokens [B] long, logprobs [B] float)."""
    logits = logits.float()
    if rows.all_greedy:
        tokens = logits.argmax(dim=-1)
        return tokens, logits.log_softmax(dim=-1).gather(-1, tokens[:, None]).squeeze(-1)
    temp = torch.where(rows.temperature > 0, rows.temperature, torch.ones_like(rows.temperature))
    scaled = logits / temp[:, None]
    logp = scaled.log_softmax(dim=-1)
    filtered = filter_top_k_top_p(scaled, rows.top_k, rows.top_p) if rows.any_filter else scaled
    probs = filtered.softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_(generator=generator)
    for i, g in enumerate(rows.generators):
        if g is not None:
            noise[i].exponential_(generator=g)
    tokens = (probs / noise).argmax(dim=-1)
    if rows.any_greedy:
        tokens = torch.where(rows.temperature > 0, tokens, logits.argmax(dim=-1))
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
