"""Batched sampling with per-row settings: one decode step's logits -> (token, log-prob) per row.

Log-probs are those of the sampling distribution after temperature and BEFORE
top-k/top-p filtering: ``log_softmax(logits / temperature)`` (``log_softmax(logits)``
for greedy rows). The trainer recomputes old log-probs with the actor; rollout
log-probs serve as a check of engine/actor agreement, and this choice makes
them comparable with the actor's full-vocabulary log-probs at the same
temperature.

Sampling inverts each row's CDF at one uniform number per row and step (``invert_cdf``: blocks of
tokens, then the tokens of one block): a categorical draw in a few kernels for the whole batch.
A seeded row takes its number from its own ``random.Random`` on the host, so the same seed
gives the same samples whatever the batch around it, and all rows' numbers reach the device in
one copy rather than one kernel launch per seeded row.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from verl_agent.engine.contract import SamplingParams


def row_rng(sampling: SamplingParams) -> random.Random | None:
    """The host RNG of a seeded sampled request (None: unseeded or greedy)."""
    return random.Random(int(sampling.seed)) if sampling.seed is not None and sampling.temperature > 0 else None


@dataclass
class RowParams:
    """Per-row sampling settings as tensors on the decode device."""

    temperature: torch.Tensor  # [B] float, 0 = greedy
    top_p: torch.Tensor  # [B] float
    top_k: torch.Tensor  # [B] long, <= 0 = off
    rngs: list[random.Random | None]  # per-row host RNG of seeded rows (one uniform number per step)
    any_filter: bool
    any_greedy: bool
    all_greedy: bool

    @classmethod
    def of(cls, params: Sequence[SamplingParams | None], rngs: list[random.Random | None], device: torch.device
           ) -> RowParams:  # fmt: skip
        """Rows with these settings (None: an idle row, sampled greedily) in one host-to-device copy."""
        host = torch.tensor([[p.temperature if p is not None else 0.0 for p in params],
                             [p.top_p if p is not None else 1.0 for p in params],
                             [float(p.top_k) if p is not None else -1.0 for p in params]], dtype=torch.float32)
        dev = host.to(device, non_blocking=True)
        live = [p for p in params if p is not None and p.temperature > 0]
        return cls(temperature=dev[0], top_p=dev[1], top_k=dev[2].long(), rngs=list(rngs),
                   any_filter=any(p.top_k > 0 or p.top_p < 1.0 for p in live),
                   any_greedy=len(live) < len(params), all_greedy=not live)  # fmt: skip

    @classmethod
    def build(cls, params: Sequence[SamplingParams], device: torch.device) -> RowParams:
        """Rows for fresh requests: each seeded row gets its RNG from its seed."""
        return cls.of(params, [row_rng(p) for p in params], device)


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


CDF_BLOCK = 128  # tokens per block of `invert_cdf`


def invert_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of `probs` [B, V] (unnormalised, >= 0), the first token whose cumulative mass exceeds u x the
    row's total (u [B] in [0, 1)): token i with probability p_i, never one of mass 0.

    In two levels, blocks of CDF_BLOCK tokens and then the tokens of the chosen block: a cumulative sum along
    a whole vocabulary row is one long scan per row, which leaves most of a GPU idle for a batch of rows."""
    b, v = probs.shape
    blocks = (F.pad(probs, (0, -v % CDF_BLOCK)) if v % CDF_BLOCK else probs).view(b, -1, CDF_BLOCK)
    mass = blocks.sum(dim=-1)
    cdf = mass.cumsum(dim=-1)
    zero = torch.zeros((), dtype=probs.dtype, device=probs.device)
    # below the total (a target at the total would pass the last token of mass > 0), then a block of mass > 0
    target = torch.minimum(u[:, None].to(probs.dtype) * cdf[:, -1:], torch.nextafter(cdf[:, -1:], zero))
    k = torch.searchsorted(cdf, target.contiguous(), right=True).clamp(max=cdf.shape[1] - 1)
    inner = blocks.gather(1, k[..., None].expand(-1, -1, CDF_BLOCK)).squeeze(1).cumsum(dim=-1)
    rest = (target - (cdf.gather(1, k) - mass.gather(1, k))).clamp(min=0)  # the target past the blocks before
    rest = torch.minimum(rest, torch.nextafter(inner[:, -1:], zero))  # the block's own sum, rounded otherwise
    j = torch.searchsorted(inner, rest.contiguous(), right=True).clamp(max=CDF_BLOCK - 1)
    return (k * CDF_BLOCK + j).squeeze(-1)


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
    probs = filter_top_k_top_p(scaled, rows.top_k, rows.top_p).softmax(dim=-1) if rows.any_filter else logp.exp()
    u = torch.rand(len(rows.rngs), device=logits.device, generator=generator)
    if any(r is not None for r in rows.rngs):  # seeded rows: their own numbers, one copy for the batch
        own = torch.tensor([r.random() if r is not None else -1.0 for r in rows.rngs], dtype=torch.float32)
        own = own.to(logits.device, non_blocking=True)
        u = torch.where(own >= 0, own, u)
    tokens = invert_cdf(probs, u)
    if rows.any_greedy:
        tokens = torch.where(rows.temperature > 0, tokens, logits.argmax(dim=-1))
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
