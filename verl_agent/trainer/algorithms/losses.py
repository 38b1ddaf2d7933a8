"""Masked reductions and the trainer's losses, as pure tensor functions.

Every tensor is padded ``[B, T]`` with a ``response_mask`` ``[B, T]`` that is 1
exactly on the model's own tokens. Tool, user and template tokens (mask 0) may
sit in the middle of a multi-turn trajectory; they never contribute to a loss
or a metric, and they receive exactly zero gradient even if the padded values
there are garbage (reductions use ``torch.where``, not multiplication, so an
``inf`` or ``nan`` at a masked position cannot leak in).

Policy losses are registered by name in ``verl_agent.registry.POLICY_LOSSES`` (the value of
``actor_rollout_ref.actor.policy_loss.loss_mode``). Metrics are returned as
detached 0-d tensors so that the caller decides when to synchronise a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import Tensor

from verl_agent.registry import POLICY_LOSSES

__all__ = [
    "LOSS_AGG_MODES", "KL_PENALTIES", "POLICY_LOSSES", "PolicyLossFn",
    "masked_sum", "masked_mean", "agg_loss", "kl_penalty", "entropy_from_logits",
    "register_policy_loss", "get_policy_loss", "compute_policy_loss", "vanilla_policy_loss",
    "gspo_policy_loss", "value_loss", "chunked_log_probs",
]

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
KL_PENALTIES = ("k1", "kl", "abs", "mse", "k2", "low_var_kl", "k3")


def _check_same_shape(mask: Tensor, **tensors: Tensor) -> None:
    for name, t in tensors.items():
        if t.shape != mask.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)} but response_mask has {tuple(mask.shape)}")


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``x`` where ``mask`` is set; masked positions get zero gradient even if non-finite."""
    picked = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return picked.sum() if dim is None else picked.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean over masked-in entries; 0 (not nan) when nothing is masked in."""
    count = mask.sum() if dim is None else mask.sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1).to(x.dtype)


def agg_loss(
    loss_mat: Tensor, mask: Tensor, mode: str = "token-mean", *,
    global_token_count: float | Tensor | None = None, global_seq_count: float | Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> Tensor:
    """Reduce a ``[B, T]`` per-token loss to a scalar (``actor.loss_agg_mode``).

    ``token-mean``: sum over all model tokens / number of model tokens.
    ``seq-mean-token-sum``: per sequence sum of tokens, mean over sequences.
    ``seq-mean-token-mean``: per sequence mean of tokens, mean over sequences.
    ``seq-mean-token-sum-norm``: per sequence sum / ``loss_scale_factor`` (Dr. GRPO's constant
    normaliser, the trainer passes data.max_response_length as verl does), mean over sequences.
    Without it the divisor is T, the padded width, which differs between micro-batches.

    Sequences without any model token (e.g. a filtered group) do not count in a
    sequence mean. For gradient accumulation pass the totals of the whole step
    (``global_token_count`` for token-mean, ``global_seq_count`` for the seq
    modes) and SUM the micro-batch losses: the result then equals the loss of
    the full batch in one piece. Under DDP/FSDP, whose all-reduce averages
    gradients over ranks, pass the step total divided by the world size.
    """
    _check_same_shape(mask, loss_mat=loss_mat)
    if mode == "token-mean":
        denom = mask.sum() if global_token_count is None else global_token_count
        return masked_sum(loss_mat, mask) / _as_denominator(denom, loss_mat)
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; expected one of {list(LOSS_AGG_MODES)}")
    per_seq = masked_sum(loss_mat, mask, dim=-1)
    tokens = mask.sum(-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / tokens.clamp(min=1).to(loss_mat.dtype)
    elif mode == "seq-mean-token-sum-norm":
        per_seq = per_seq / (loss_mat.shape[-1] if loss_scale_factor is None else loss_scale_factor)
    nseq = (tokens > 0).sum() if global_seq_count is None else global_seq_count
    return per_seq.sum() / _as_denominator(nseq, loss_mat)


def _as_denominator(n: float | Tensor, like: Tensor) -> Tensor:
    n = torch.as_tensor(n, dtype=like.dtype, device=like.device)
    return n.clamp(min=1)  # an empty batch gives loss 0, not nan


def kl_penalty(log_prob: Tensor, ref_log_prob: Tensor, kind: str = "low_var_kl") -> Tensor:
    """Per-token estimate of KL(policy || ref) from sampled-token log-probs.

    ``k1``/``kl``: log p - log q (unbiased, high variance, can be negative).
    ``abs``: |log p - log q|.  ``k2``/``mse``: 0.5 (log p - log q)^2.
    ``k3``/``low_var_kl``: q/p - log(q/p) - 1 (Schulman's unbiased, non-negative
    estimator), with log(q/p) clamped to [-20, 20] and the result to [-10, 10]
    as verl does, so one wild token cannot blow up the loss.
    A ``+`` suffix (e.g. ``k3+``) keeps the value of the estimator but takes
    the gradient of k2, which is unbiased for the KL gradient.
    """
    if kind.endswith("+"):
        value = kl_penalty(log_prob, ref_log_prob, kind[:-1])
        k2 = 0.5 * (log_prob - ref_log_prob).square()
        return k2 - k2.detach() + value.detach()
    diff = log_prob - ref_log_prob
    if kind in ("k1", "kl"):
        return diff
    if kind == "abs":
        return diff.abs()
    if kind in ("k2", "mse"):
        return 0.5 * diff.square()
    if kind in ("k3", "low_var_kl"):
        log_ratio = (-diff).clamp(-20.0, 20.0)  # log(q/p)
        return (log_ratio.exp() - log_ratio - 1).clamp(-10.0, 10.0)
    raise ValueError(f"unknown kl penalty {kind!r}; expected one of {list(KL_PENALTIES)} (optionally with '+')")


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the softmax over the last dim: logsumexp(z) - sum softmax(z) z."""
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)


class _ChunkedLogProbs(torch.autograd.Function):
    """log softmax(h W^T / T)[target] (and entropy) computed ``chunk`` rows at a time.

    Only one chunk's logits [chunk, V] ever exist (in fp32); the backward pass
    recomputes them chunk by chunk instead of keeping them, like a fused
    linear-cross-entropy. Numerics follow the plain path: the matmul runs in the
    weight's dtype (bf16 under mixed precision) and everything after it in fp32.
    Every step after the matmul works in place, so a chunk holds at most two fp32
    [chunk, V] buffers (`LOGIT_BUFFERS`; the memory plan counts them): with a 152k
    vocabulary each is 1.2 GB at 2,048 rows, and every one saved is room for
    thousands more tokens in a micro-batch.
    """

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, inv_temp: float, chunk: int,
                with_entropy: bool) -> tuple[Tensor, Tensor]:
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(logp)
        ent = torch.empty_like(logp) if with_entropy else torch.zeros(0, device=hidden.device)
        for a in range(0, n, chunk):
            z = _chunk_logits(hidden[a:a + chunk], weight, inv_temp)
            lse[a:a + chunk] = z.logsumexp(-1)
            logp[a:a + chunk] = z.gather(-1, targets[a:a + chunk, None]).squeeze(-1) - lse[a:a + chunk]
            if with_entropy:
                z.sub_(lse[a:a + chunk, None])  # z is now log p
                ent[a:a + chunk] = -z.exp().mul_(z).sum(-1)
            del z
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.inv_temp, ctx.chunk, ctx.with_entropy = inv_temp, chunk, with_entropy
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp: Tensor, g_ent: Tensor):
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) \
            if ctx.needs_input_grad[1] else None
        use_ent = ctx.with_entropy and g_ent is not None
        for a in range(0, hidden.shape[0], ctx.chunk):
            h, rows = hidden[a:a + ctx.chunk], slice(a, a + ctx.chunk)
            logp = _chunk_logits(h, weight, ctx.inv_temp).sub_(lse[rows, None])
            gz = logp.exp()  # p
            g = g_logp[rows, None].float()
            if use_ent:  # dH/dz = -p (log p + H): logp's buffer becomes that term times the entropy's gradient
                logp.add_(ent[rows, None]).mul_(gz).mul_(g_ent[rows, None].float())
            gz.mul_(-g).scatter_add_(-1, targets[rows, None], g)  # d log p_t / dz = onehot(t) - p
            if use_ent:
                gz.sub_(logp)
            del logp
            if ctx.inv_temp != 1.0:
                gz.mul_(ctx.inv_temp)
            gz = gz.to(weight.dtype)
            if grad_h is not None:
                grad_h[rows] = gz @ weight
            if grad_w is not None:
                grad_w += gz.t() @ h  # in place: the product is upcast as it is added, no fp32 copy of it
            del gz
        return grad_h, grad_w.to(weight.dtype) if grad_w is not None else None, None, None, None, None


LOGIT_BUFFERS = 2  # fp32 [chunk, vocab] buffers `_ChunkedLogProbs` holds at once


def _chunk_logits(h: Tensor, weight: Tensor, inv_temp: float) -> Tensor:
    z = (h @ weight.t()).float()
    return z.mul_(inv_temp) if inv_temp != 1.0 else z


def chunked_log_probs(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float = 1.0,
                      chunk: int = 2048, with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """Log-probs of ``targets`` [N] under softmax(hidden [N, H] @ weight [V, H]^T / temperature), fp32.

    Equal to ``(hidden @ weight.T).float().div(T).log_softmax(-1).gather(targets)`` (and
    ``entropy_from_logits`` of the same logits when ``with_entropy``), differentiable in
    ``hidden`` and ``weight``, but the [N, V] logits never exist at once: with a 152k
    vocabulary they would take 0.6 GB per 1k tokens in fp32, several times over in backward.
    """
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(f"chunked_log_probs: hidden must be [N, H] and targets [N], got {tuple(hidden.shape)} "
                         f"and {tuple(targets.shape)}")
    inv_temp = 1.0 / temperature if temperature > 0 else 1.0
    logp, ent = _ChunkedLogProbs.apply(hidden, weight, targets, inv_temp, max(1, chunk), with_entropy)
    return logp, (ent if with_entropy else None)


class PolicyLossFn(Protocol):
    """The signature every registered policy loss (``register_policy_loss``) has."""

    def __call__(
        self, old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor, *,
        clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float | None, loss_agg_mode: str,
        global_token_count: float | Tensor | None = None, global_seq_count: float | Tensor | None = None,
        loss_scale_factor: float | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]: ...


def register_policy_loss(name: str) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Register a policy loss as ``actor_rollout_ref.actor.policy_loss.loss_mode=name``."""
    return POLICY_LOSSES.register(name)


def get_policy_loss(name: str) -> PolicyLossFn:
    """The loss registered as `name`; an unknown name raises `RegistryError` (a ValueError) listing them."""
    return POLICY_LOSSES.get(name)


def compute_policy_loss(name: str, old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor,
                        response_mask: Tensor, **kwargs) -> tuple[Tensor, dict[str, Tensor]]:
    """Look up ``name`` in ``POLICY_LOSSES`` and call it."""
    return get_policy_loss(name)(old_log_prob, log_prob, advantages, response_mask, **kwargs)


def _check_clip(low: float, high: float, c: float | None) -> None:
    if not (0 <= low < 1) or high < 0:
        raise ValueError(f"clip ratios must satisfy 0 <= clip_ratio_low < 1 and clip_ratio_high >= 0, "
                         f"got {low}, {high}")
    if c is not None and c <= 1.0:
        raise ValueError(f"clip_ratio_c (dual clip) must be > 1.0, got {c}")


@register_policy_loss("vanilla")
def vanilla_policy_loss(
    old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor, *,
    clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2, clip_ratio_c: float | None = 3.0,
    loss_agg_mode: str = "token-mean",
    global_token_count: float | Tensor | None = None, global_seq_count: float | Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate with asymmetric bounds (DAPO clip-higher) and dual clip.

    per token: max(-A r, -A clip(r, 1-low, 1+high)); for A < 0 additionally capped
    at -A c (dual clip, arXiv:1912.09729) so a huge ratio on a bad token cannot
    produce an unbounded loss. ``clip_ratio_c=None`` disables the dual clip.
    """
    _check_same_shape(response_mask, old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages)
    _check_clip(clip_ratio_low, clip_ratio_high, clip_ratio_c)
    log_ratio = (log_prob - old_log_prob).clamp(-20.0, 20.0)  # exp() stays finite
    ratio = log_ratio.exp()
    loss1 = -advantages * ratio
    loss2 = -advantages * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    clipped = torch.maximum(loss1, loss2)
    metrics = {"pg_clipfrac": masked_mean((loss2 > loss1).float(), response_mask).detach(),
               "ppo_kl": masked_mean(-log_ratio, response_mask).detach()}
    if clip_ratio_c is not None:
        loss3 = -advantages * clip_ratio_c
        lower = (advantages < 0) & (clipped > loss3)
        clipped = torch.where(advantages < 0, torch.minimum(clipped, loss3), clipped)
        metrics["pg_clipfrac_lower"] = masked_mean(lower.float(), response_mask).detach()
    else:
        metrics["pg_clipfrac_lower"] = torch.zeros((), device=log_prob.device)
    loss = agg_loss(clipped, response_mask, loss_agg_mode,
                    global_token_count=global_token_count, global_seq_count=global_seq_count,
                    loss_scale_factor=loss_scale_factor)
    return loss, metrics


@register_policy_loss("gspo")
def gspo_policy_loss(
    old_log_prob: Tensor, log_prob: Tensor, advantages: Tensor, response_mask: Tensor, *,
    clip_ratio_low: float = 3e-4, clip_ratio_high: float = 4e-4, clip_ratio_c: float | None = None,
    loss_agg_mode: str = "seq-mean-token-mean",
    global_token_count: float | Tensor | None = None, global_seq_count: float | Tensor | None = None,
    loss_scale_factor: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (arXiv:2507.18071): clip a sequence-level ratio s = exp(mean_t log r_t).

    Per token we use s_t = sg(s) * pi_t / sg(pi_t): its value is s for every
    model token of the sequence and its gradient is s * grad log pi_t, so with
    ``seq-mean-token-mean`` (the paper's objective) the gradient is the paper's.
    The clip range is tiny (the paper uses 3e-4 / 4e-4) because s is a geometric
    mean. ``clip_ratio_c`` is accepted for a uniform signature and ignored.
    """
    del clip_ratio_c
    _check_same_shape(response_mask, old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages)
    _check_clip(clip_ratio_low, clip_ratio_high, None)
    log_ratio = log_prob - old_log_prob
    seq_log_ratio = masked_mean(log_ratio, response_mask, dim=-1)  # [B]
    token_log_s = log_prob - log_prob.detach() + seq_log_ratio.detach().unsqueeze(-1)
    s = token_log_s.clamp(max=10.0).exp()
    loss1 = -advantages * s
    loss2 = -advantages * s.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    loss = agg_loss(torch.maximum(loss1, loss2), response_mask, loss_agg_mode,
                    global_token_count=global_token_count, global_seq_count=global_seq_count,
                    loss_scale_factor=loss_scale_factor)
    metrics = {"pg_clipfrac": masked_mean((loss2 > loss1).float(), response_mask).detach(),
               "ppo_kl": masked_mean(-log_ratio, response_mask).detach(),
               "pg_clipfrac_lower": torch.zeros((), device=log_prob.device)}
    return loss, metrics


def value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, cliprange_value: float | None,
    loss_agg_mode: str = "token-mean", *, global_token_count: float | Tensor | None = None,
    global_seq_count: float | Tensor | None = None, loss_scale_factor: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Critic loss 0.5 * max((v - R)^2, (clip(v, v_old +- eps) - R)^2), PPO's clipped value loss.

    ``cliprange_value=None`` gives the plain squared error. Returns (loss, {"vf_clipfrac"}).
    """
    _check_same_shape(mask, values=values, old_values=old_values, returns=returns)
    loss1 = (values - returns).square()
    if cliprange_value is None:
        per_token, clipfrac = loss1, torch.zeros((), device=values.device)
    else:
        clipped_v = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
        loss2 = (clipped_v - returns).square()
        per_token = torch.maximum(loss1, loss2)
        clipfrac = masked_mean((loss2 > loss1).float(), mask).detach()
    loss = 0.5 * agg_loss(per_token, mask, loss_agg_mode,
                          global_token_count=global_token_count, global_seq_count=global_seq_count,
                          loss_scale_factor=loss_scale_factor)
    return loss, {"vf_clipfrac": clipfrac}
