"""What one rank computes on its shard: log-probs, values, and the PPO/GRPO updates of actor and critic.

Collective rules (FSDP2 all-gathers/reduce-scatters inside forward/backward):
every rank must run the same number of forward/backward passes, so the number
of micro-batches is agreed with an all-reduce(MAX) and a rank with fewer
sequences runs empty micro-batches (a 2-token dummy whose loss is multiplied
by 0). Loss normalisation uses the GLOBAL token count of the mini-batch
divided by the world size (FSDP averages gradients over ranks), so N ranks
with micro-batches compute exactly the gradient of the whole mini-batch in one
piece (tests/trainer/test_fsdp_invariance.py).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from verl_agent.trainer.algorithms import actor_loss, entropy_from_logits, value_loss
from verl_agent.trainer.batch import TrainSeq, pack, pad_field, response_positions, split_by_tokens

__all__ = ["MicroBatching", "forward_log_probs", "forward_values", "micro_batches", "update_actor", "update_critic"]

_Z = torch.zeros(1)
# Stands in for an empty micro-batch so that every rank runs the same collectives; its loss mask is 0.
_DUMMY = TrainSeq(input_ids=[0, 0], prompt_len=1, loss_mask=_Z, old_log_probs=_Z, ref_log_probs=_Z,
                  old_values=_Z, advantages=_Z, returns=_Z)


@dataclass
class MicroBatching:
    """How a rank cuts its sequences: by token budget (dynamic) or by count."""

    dynamic: bool = True
    max_tokens: int = 4096
    per_gpu: int = 4


def _all_reduce(t: Tensor, op=dist.ReduceOp.SUM) -> Tensor:
    """All-reduce a small CPU tensor on the group's device (NCCL cannot reduce CPU tensors); no-op alone."""
    if not dist.is_initialized():
        return t
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else t.device
    out = t.to(dev)
    dist.all_reduce(out, op=op)
    return out.cpu()


def micro_batches(seqs: list[TrainSeq], mb: MicroBatching) -> list[list[TrainSeq]]:
    """Micro-batches of this rank, padded with empty ones to the max count over ranks."""
    lengths = [s.num_tokens for s in seqs]
    if mb.dynamic:
        groups = split_by_tokens(lengths, mb.max_tokens)
    else:
        groups = [list(range(i, min(i + mb.per_gpu, len(seqs)))) for i in range(0, len(seqs), mb.per_gpu)]
    count = _all_reduce(torch.tensor([len(groups)]), dist.ReduceOp.MAX)
    groups += [[] for _ in range(int(count) - len(groups))]
    return [[seqs[i] for i in g] for g in groups]


def forward_log_probs(model: nn.Module, seqs: list[TrainSeq], temperature: float, device: torch.device,
                      with_entropy: bool = False) -> tuple[list[Tensor], list[Tensor] | None]:
    """Per-sequence log-probs of the response tokens (and entropies), from ONE packed forward."""
    real = seqs or [_DUMMY]
    ids, pos = pack(real, device)
    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits[0]
    rows = response_positions(real, device)
    picked = logits[rows].float() / (temperature if temperature > 0 else 1.0)
    targets = ids[0, rows + 1]
    logp = picked.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
    sizes = [s.response_len for s in real]
    ent = list(entropy_from_logits(picked).split(sizes)) if with_entropy else None
    return list(logp.split(sizes)), ent


def forward_values(critic: nn.Module, seqs: list[TrainSeq], device: torch.device) -> list[Tensor]:
    """Per-sequence values at the positions that predict each response token (aligned with log-probs)."""
    real = seqs or [_DUMMY]
    ids, pos = pack(real, device)
    values = critic(ids, pos)[0]
    return list(values[response_positions(real, device)].split([s.response_len for s in real]))


def _global_counts(seqs: list[TrainSeq]) -> tuple[float, float]:
    """(tokens, sequences) of the whole mini-batch over all ranks, divided by the world size."""
    t = torch.tensor([sum(float(s.loss_mask.sum()) for s in seqs), float(sum(1 for s in seqs if s.loss_mask.any()))],
                     dtype=torch.float64)
    t = _all_reduce(t)
    world = dist.get_world_size() if dist.is_initialized() else 1
    return float(t[0]) / world, float(t[1]) / world


def _clip_and_step(model: nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float) -> float:
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else float("inf"))
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    if torch.isfinite(norm):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm)


def _chunks(seqs: list[TrainSeq], k: int) -> list[list[TrainSeq]]:
    """k contiguous mini-batches (sizes differ by at most one)."""
    q, r = divmod(len(seqs), k)
    out, start = [], 0
    for i in range(k):
        end = start + q + (1 if i < r else 0)
        out.append(seqs[start:end])
        start = end
    return out


def update_actor(model: nn.Module, optimizer: torch.optim.Optimizer, seqs: list[TrainSeq], cfg, temperature: float,
                 device: torch.device, n_minibatches: int, mb: MicroBatching) -> dict[str, float]:
    """ppo_epochs x mini-batches of clipped policy-gradient steps (``cfg`` = ActorConfig)."""
    low = cfg.clip_ratio_low if cfg.clip_ratio_low is not None else cfg.clip_ratio
    high = cfg.clip_ratio_high if cfg.clip_ratio_high is not None else cfg.clip_ratio
    kl_coef = cfg.kl_loss_coef if cfg.use_kl_loss else 0.0
    sums: dict[str, float] = defaultdict(float)
    model.train()
    for _ in range(cfg.ppo_epochs):
        for mini in _chunks(seqs, n_minibatches):
            gtok, gseq = _global_counts(mini)
            for micro in micro_batches(mini, mb):
                real = micro or [_DUMMY]
                logp, ent = forward_log_probs(model, real, temperature, device, with_entropy=cfg.entropy_coeff != 0)
                pad = lambda name: pad_field([getattr(s, name) for s in real], device)  # noqa: E731
                loss, m = actor_loss(
                    pad("old_log_probs"), pad_field(logp), pad("advantages"), pad("loss_mask"),
                    loss_mode=cfg.policy_loss.loss_mode, clip_ratio_low=low, clip_ratio_high=high,
                    clip_ratio_c=cfg.clip_ratio_c, loss_agg_mode=cfg.loss_agg_mode,
                    entropy=pad_field(ent) if ent is not None else None, entropy_coeff=cfg.entropy_coeff,
                    ref_log_prob=pad("ref_log_probs") if kl_coef else None, kl_loss_coef=kl_coef,
                    kl_loss_type=cfg.kl_loss_type, global_token_count=gtok, global_seq_count=gseq,
                )  # fmt: skip
                loss.backward()
                tokens = float(sum(s.loss_mask.sum() for s in micro))
                for k, v in m.items():
                    sums[k] += float(v) * (1.0 if k in ("pg_loss", "kl_loss", "entropy") else tokens)
                sums["_tokens"] += tokens
            sums["grad_norm"] += _clip_and_step(model, optimizer, cfg.grad_clip)
            sums["_steps"] += 1
    return _finish(sums)


def update_critic(critic: nn.Module, optimizer: torch.optim.Optimizer, seqs: list[TrainSeq], cfg, grad_clip: float,
                  device: torch.device, n_minibatches: int, epochs: int, mb: MicroBatching) -> dict[str, float]:
    """Clipped value regression on the GAE returns (``cfg`` = CriticConfig)."""
    sums: dict[str, float] = defaultdict(float)
    critic.train()
    for _ in range(epochs):
        for mini in _chunks(seqs, n_minibatches):
            gtok, gseq = _global_counts(mini)
            for micro in micro_batches(mini, mb):
                real = micro or [_DUMMY]
                pad = lambda name: pad_field([getattr(s, name) for s in real], device)  # noqa: E731
                loss, m = value_loss(pad_field(forward_values(critic, real, device)), pad("old_values"), pad("returns"),
                                     pad("loss_mask"), cfg.cliprange_value, cfg.loss_agg_mode,
                                     global_token_count=gtok, global_seq_count=gseq)  # fmt: skip
                loss.backward()
                tokens = float(sum(s.loss_mask.sum() for s in micro))
                sums["vf_loss"] += float(loss)
                sums["vf_clipfrac"] += float(m["vf_clipfrac"]) * tokens
                sums["_tokens"] += tokens
            sums["critic_grad_norm"] += _clip_and_step(critic, optimizer, grad_clip)
            sums["_steps"] += 1
    return _finish(sums)


def _finish(sums: dict[str, float]) -> dict[str, float]:
    """Loss terms were normalised globally, so their sum over micro-batches is this rank's share;
    ratios are token-weighted."""
    steps, tokens = max(sums.pop("_steps", 1), 1), max(sums.pop("_tokens", 0), 1)
    out = {}
    for k, v in sums.items():
        if k in ("pg_loss", "kl_loss", "entropy", "vf_loss", "grad_norm", "critic_grad_norm"):
            out[k] = v / steps
        else:
            out[k] = v / tokens
    return out
