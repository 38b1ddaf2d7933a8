"""What one rank computes on its shard: log-probs, values, and the PPO/GRPO updates of actor and critic.

Collective rules (FSDP2 all-gathers/reduce-scatters inside forward/backward):
every rank must run the same number of forward/backward passes, so the number
of micro-batches is agreed with an all-reduce(MAX) and a rank with fewer
sequences runs empty micro-batches (a 2-token dummy whose loss is multiplied
by 0). Loss normalisation uses the GLOBAL token count of the mini-batch
divided by the world size (FSDP averages gradients over ranks), so N ranks
with micro-batches compute exactly the gradient of the whole mini-batch in one
piece (tests/trainer/test_fsdp_invariance.py).

Forward passes take a micro-batch as a right-padded [B, L] batch with an
attention mask, sequences of similar length grouped together (`split_padded`)
so that padding stays small. One packed row of all sequences (no padding) is
not used: without a varlen attention kernel its block-diagonal mask makes
attention cost grow with (sum of lengths)^2.

Log-probs never materialise the [tokens, vocab] logits: the model's lm_head is
switched to `LogProbHead`, which (only while `forward_log_probs` asks) turns the
hidden states of the response positions straight into log-probs, a chunk of
rows at a time (`losses.chunked_log_probs`), inside the model's own forward so
FSDP gathers and reduces the head's weight as usual.

Shared prefixes (`shared_prefix.py`): with ``MicroBatching.shared_prefix`` > 0, sequences that start with
at least that many equal tokens (a GRPO group's prompt) are cut into micro-batches as packs and run as one
row each, their common prefix once; the outputs equal the padded rows' (tests/trainer/test_shared_prefix.py).

On-policy shortcut: a sequence whose ``old_log_probs`` is None is trained
against its own current log-probs, detached (ratio 1: the PPO gradient at
ratio 1 without a separate forward pass).
"""

from __future__ import annotations

import ctypes
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from verl_agent.trainer.algorithms import actor_loss, entropy_from_logits, value_loss
from verl_agent.trainer.algorithms.losses import chunked_log_probs
from verl_agent.trainer.policy.batch import TrainSeq, pad_field
from verl_agent.trainer.policy.prepare import add_rollout_is_stats, rollout_is_metrics, rollout_is_weights
from verl_agent.trainer.policy.shared_prefix import Pack, pack_sequences, packed_batch, supports_packing

__all__ = ["LogProbHead", "MicroBatching", "forward_log_probs", "forward_values", "micro_batches", "model_inputs",
           "reduce_op", "shared_packs", "update_actor", "update_critic"]

# A pack's row attends through a [W, W] mask (the attention kernels do not skip its masked blocks): packs stay
# below this width so that the mask and the attention over it stay small beside the activations.
MAX_PACK_TOKENS = 8192

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
    shared_prefix: int = 0  # leading tokens sequences must share to run as one row (0: padded rows only)


def _all_reduce(t: Tensor, op=dist.ReduceOp.SUM) -> Tensor:
    """All-reduce a small CPU tensor on the group's device (NCCL cannot reduce CPU tensors); no-op alone."""
    if not dist.is_initialized():
        return t
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else t.device
    out = t.to(dev)
    dist.all_reduce(out, op=op)
    return out.cpu()


def reduce_op(t: Tensor, op: str = "sum") -> Tensor:
    """`_all_reduce` by name ("sum" or "max"): the all-reduce the preparation steps (prepare.py) take."""
    return _all_reduce(t, dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)


def micro_batches(seqs: list[TrainSeq], mb: MicroBatching) -> list[list[TrainSeq]]:
    """Micro-batches of this rank, padded with empty ones to the max count over ranks.

    With ``mb.shared_prefix`` the units are packs (`pack_sequences`): a pack's members land in one micro-batch,
    and the token budget counts the packed row, not the rows it replaces.
    """
    if mb.shared_prefix > 0 and len(seqs) > 1:
        cap = min(mb.max_tokens, MAX_PACK_TOKENS) if mb.dynamic else MAX_PACK_TOKENS
        packs = pack_sequences(seqs, mb.shared_prefix, cap)
        units, lengths = [p.seqs for p in packs], [p.num_tokens for p in packs]
    else:
        units, lengths = [[s] for s in seqs], [s.num_tokens for s in seqs]
    if mb.dynamic:
        out = [[s for i in g for s in units[i]] for g in split_padded(lengths, mb.max_tokens)]
    else:
        flat = [s for u in units for s in u]
        out = [flat[i : i + mb.per_gpu] for i in range(0, len(flat), mb.per_gpu)]
    count = _all_reduce(torch.tensor([len(out)]), dist.ReduceOp.MAX)
    return out + [[] for _ in range(int(count) - len(out))]


def split_padded(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices grouped so that each group's PADDED size (count x longest) stays <= max_tokens.

    Sequences are taken longest first, so a group holds similar lengths and padding stays small; a
    sequence longer than the budget gets a group of its own (never dropped).
    """
    if max_tokens < 1:
        raise ValueError(f"ppo_max_token_len_per_gpu must be >= 1, got {max_tokens}")
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= max_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def padded_batch(seqs: list[TrainSeq], device: torch.device | str) -> tuple[Tensor, Tensor, Tensor]:
    """input_ids [B, L] right-padded with 0, attention_mask [B, L], and the flat indices (into B*L) of the
    positions that predict each response token, in sequence order (position t-1 predicts token t)."""
    width = max(s.num_tokens for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    rows = []
    for b, s in enumerate(seqs):
        ids[b, : s.num_tokens] = torch.as_tensor(s.input_ids)
        mask[b, : s.num_tokens] = 1
        rows.append(torch.arange(b * width + s.prompt_len - 1, b * width + s.num_tokens - 1))
    return ids.to(device), mask.to(device), torch.cat(rows).to(device)


class LogProbHead(nn.Linear):
    """An lm_head that returns [1, R, 2] = (log-prob of the target, entropy) per kept row while ``request`` is set.

    Set by `forward_log_probs` around one forward call (targets, temperature, with_entropy, chunk rows);
    otherwise it is the plain linear layer (same parameter names, same tying), so generation, export and
    weight sync see an ordinary model.
    """

    request: tuple[Tensor, Tensor, float, bool, int] | None = None

    def forward(self, hidden: Tensor) -> Tensor:
        if self.request is None:
            return super().forward(hidden)
        index, targets, temperature, with_entropy, chunk = self.request
        picked = hidden.reshape(-1, hidden.shape[-1])[index]
        logp, ent = chunked_log_probs(picked, self.weight, targets, temperature, chunk, with_entropy)
        ent = ent if ent is not None else torch.zeros_like(logp)
        return torch.stack([logp[None], ent[None]], -1)  # [1, R, 2]; not a view (FSDP2 warns about views)


def _fused_head(model: nn.Module) -> LogProbHead | None:
    """The model's lm_head as a LogProbHead (switched on first use), or None where the fused path does not apply:
    no plain bias-free linear head, or logits post-processed after the head (soft-capping, scaling)."""
    head = getattr(model, "lm_head", None)
    if isinstance(head, LogProbHead):
        return head
    conf = getattr(model, "config", None)
    if (type(head) is not nn.Linear or head.bias is not None
            or getattr(conf, "final_logit_softcapping", None) or getattr(conf, "logit_scale", None)):
        return None
    head.__class__ = LogProbHead  # same object, parameters and hooks: only forward changes
    return head


def shared_packs(model: nn.Module, seqs: list[TrainSeq], shared_prefix: int) -> list[Pack] | None:
    """`seqs` as packs when some share ``shared_prefix`` (> 0) leading tokens and the model takes packed rows;
    else None (padded rows)."""
    if shared_prefix <= 0 or len(seqs) < 2 or not supports_packing(model):
        return None
    packs = pack_sequences(seqs, shared_prefix, MAX_PACK_TOKENS)
    return packs if any(len(p.seqs) > 1 for p in packs) else None


def model_inputs(model: nn.Module, seqs: list[TrainSeq], device: torch.device, shared_prefix: int = 0
                 ) -> tuple[dict[str, Tensor], Tensor, Tensor, list[TrainSeq]]:  # fmt: skip
    """The forward's keyword inputs for `seqs`, the flat indices of the positions that predict each response
    token and the targets there, and the sequences in the order of those rows: packed rows where
    `shared_packs` gives packs, else one right-padded row per sequence."""
    packs = shared_packs(model, seqs, shared_prefix)
    if packs is None:
        ids, mask, rows = padded_batch(seqs, device)
        return {"input_ids": ids, "attention_mask": mask}, rows, ids.view(-1)[rows + 1], seqs
    ids, pos, mask, rows, targets, order = packed_batch(packs, device)
    if model.config._attn_implementation == "eager":  # eager attention adds its mask to the scores
        mask = torch.zeros(mask.shape, device=device).masked_fill_(~mask, torch.finfo(torch.float32).min)
    return {"input_ids": ids, "position_ids": pos, "attention_mask": mask}, rows, targets, order


def forward_log_probs(model: nn.Module, seqs: list[TrainSeq], temperature: float, device: torch.device,
                      with_entropy: bool = False, chunk_tokens: int = 2048, fused: bool = True,
                      shared_prefix: int = 0) -> tuple[list[Tensor], list[Tensor] | None]:  # fmt: skip
    """Per-sequence log-probs of the response tokens (and entropies), from ONE forward of the micro-batch.

    Only the response positions reach the vocabulary projection, which runs ``chunk_tokens`` rows at a
    time, so fp32 logits exist for at most one chunk. ``fused=False`` takes the plain path (full logits,
    then log-softmax), kept as the reference. ``shared_prefix``: see `model_inputs`.
    """
    real = seqs or [_DUMMY]
    inputs, rows, targets, order = model_inputs(model, real, device, shared_prefix)
    head = _fused_head(model) if fused else None
    if head is not None:
        head.request = (rows, targets, temperature, with_entropy, chunk_tokens)
        try:
            out = model(**inputs, use_cache=False).logits[0]
        finally:
            head.request = None
        logp, ent = out[:, 0], (out[:, 1] if with_entropy else None)
    else:
        logits = model(**inputs, use_cache=False).logits
        picked = logits.reshape(-1, logits.shape[-1])[rows].float() / (temperature if temperature > 0 else 1.0)
        logp = picked.log_softmax(-1).gather(-1, targets[:, None]).squeeze(-1)
        ent = entropy_from_logits(picked) if with_entropy else None
    sizes = [s.response_len for s in order]
    at = {id(s): i for i, s in enumerate(order)}
    back = lambda parts: [parts[at[id(s)]] for s in real]  # noqa: E731 - rows came in `order`
    return back(logp.split(sizes)), (back(ent.split(sizes)) if ent is not None else None)


def forward_values(critic: nn.Module, seqs: list[TrainSeq], device: torch.device) -> list[Tensor]:
    """Per-sequence values at the positions that predict each response token (aligned with log-probs)."""
    real = seqs or [_DUMMY]
    ids, mask, rows = padded_batch(real, device)
    values = critic(ids, attention_mask=mask)
    return list(values.reshape(-1)[rows].split([s.response_len for s in real]))


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
                 device: torch.device, n_minibatches: int, mb: MicroBatching, *, loss_scale_factor: float,
                 rollout_is: tuple[str, float] | None = None) -> dict[str, float]:  # fmt: skip
    """ppo_epochs x mini-batches of clipped policy-gradient steps (``cfg`` = ActorConfig).

    ``loss_scale_factor`` (data.max_response_length): the constant divisor of seq-mean-token-sum-norm, the
    same for every micro-batch whatever its padded width (see ``agg_loss``).

    ``rollout_is`` (level, threshold): the rollout correction of sequences on the on-policy shortcut, whose
    old log-probs are this forward's own: each token's advantage is scaled by the capped weight
    pi_old / pi_engine here (what `prepare.apply_rollout_correction` does when a log-prob pass ran), and the
    ``rollout_is/*`` metrics are reduced over all ranks (collective: every rank passes the same value).

    Metrics stay on the device until the end (one synchronisation per optimizer step, for the
    gradient norm), so the host keeps queueing kernels while the device computes.
    """
    sums: dict[str, float | Tensor] = defaultdict(float)
    is_stats = torch.zeros(4, dtype=torch.float64, device=device)  # see prepare.add_rollout_is_stats
    widest = 0  # padded tokens of the largest micro-batch's rows: what the memory plan budgets (trainer/memory.py)
    run = shared = 0  # the tokens the forward passes ran (unpadded), and the prefix repeats they did not run
    model.train()
    for _ in range(cfg.ppo_epochs):
        for mini in _chunks(seqs, n_minibatches):
            gtok, gseq = _global_counts(mini)
            for micro in micro_batches(mini, mb):
                packs = shared_packs(model, micro, mb.shared_prefix)
                rows = [p.num_tokens for p in packs] if packs else [s.num_tokens for s in micro]
                widest = max(widest, len(rows) * max(rows, default=0))
                run += sum(rows)
                shared += sum(p.saved_tokens for p in packs) if packs else 0
                loss, m = _actor_loss(model, micro or [_DUMMY], cfg, temperature, device, gtok, gseq,
                                      loss_scale_factor, rollout_is, is_stats, mb.shared_prefix)
                loss.backward()
                tokens = float(sum(s.loss_mask.sum() for s in micro))
                for k, v in m.items():
                    sums[k] = sums[k] + v * (1.0 if k in ("pg_loss", "kl_loss", "entropy") else tokens)
                sums["_tokens"] += tokens
            sums["grad_norm"] += _clip_and_step(model, optimizer, cfg.grad_clip)
            sums["_steps"] += 1
    out = _finish(sums)
    out["perf/max_micro_batch_tokens"] = float(widest)
    out["perf/update_tokens"] = float(run)
    out["perf/update_tokens_shared"] = float(shared)
    if device.type == "cpu":
        release_host_memory()
    if rollout_is is not None:
        out.update(rollout_is_metrics(is_stats, reduce_op))
    return out


def release_host_memory() -> None:
    """Give the C allocator's free pages back to the OS (glibc's malloc_trim; a no-op elsewhere).

    glibc keeps the memory of freed small and medium blocks (the update's activations) for reuse, so without
    this the process would carry the update's peak into the rollout, where the KV cache comes on top of it.
    """
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _actor_loss(model: nn.Module, real: list[TrainSeq], cfg, temperature: float, device: torch.device,
                gtok: float, gseq: float, loss_scale_factor: float, rollout_is: tuple[str, float] | None = None,
                is_stats: Tensor | None = None, shared_prefix: int = 0) -> tuple[Tensor, dict[str, Tensor]]:
    """The actor objective of one micro-batch; a missing old log-prob is the current one, detached.

    On that on-policy shortcut no separate log-prob pass ran, so the health metrics it would have
    given (entropy, engine-vs-actor log-prob gap) come from this forward, detached, and so does the
    rollout correction's weight (``rollout_is``; its statistics are added to ``is_stats``).
    """
    on_policy = real[0].old_log_probs is None
    logp, ent = forward_log_probs(model, real, temperature, device,
                                  with_entropy=cfg.entropy_coeff != 0 or on_policy, shared_prefix=shared_prefix)
    kl_coef = cfg.kl_loss_coef if cfg.use_kl_loss else 0.0
    logp = pad_field(logp)
    mask = _pad([s.loss_mask for s in real], device)
    old = logp.detach() if on_policy else _pad([s.old_log_probs for s in real], device)
    advantages = _pad([s.advantages for s in real], device)
    rollout = _pad([s.rollout_log_probs for s in real], device) if on_policy and all(
        s.rollout_log_probs is not None for s in real) else None  # fmt: skip
    if on_policy and rollout_is is not None:  # one padded computation for the micro-batch, rows = sequences
        if rollout is None:
            raise ValueError("update_actor: rollout_is needs every sequence's rollout_log_probs (engine log-probs)")
        level, threshold = rollout_is
        w, raw = rollout_is_weights(old, rollout, mask, level, threshold)
        advantages = advantages * w
        add_rollout_is_stats(is_stats, w, raw, mask, threshold)
    loss, metrics = actor_loss(
        old, logp, advantages, mask,
        loss_mode=cfg.policy_loss.loss_mode,
        clip_ratio_low=cfg.clip_ratio_low if cfg.clip_ratio_low is not None else cfg.clip_ratio,
        clip_ratio_high=cfg.clip_ratio_high if cfg.clip_ratio_high is not None else cfg.clip_ratio,
        clip_ratio_c=cfg.clip_ratio_c, loss_agg_mode=cfg.loss_agg_mode,
        entropy=pad_field(ent) if ent is not None and cfg.entropy_coeff != 0 else None,
        entropy_coeff=cfg.entropy_coeff,
        ref_log_prob=_pad([s.ref_log_probs for s in real], device) if kl_coef else None, kl_loss_coef=kl_coef,
        kl_loss_type=cfg.kl_loss_type, global_token_count=gtok, global_seq_count=gseq,
        loss_scale_factor=loss_scale_factor,
    )  # fmt: skip
    if on_policy:  # token means of this micro-batch (update_actor weights them by its tokens)
        tokens = mask.sum().clamp(min=1)
        metrics["actor/entropy"] = (pad_field(ent).detach() * mask).sum() / tokens
        if rollout is not None:
            metrics["rollout/actor_logprob_diff_mean"] = ((logp.detach() - rollout).abs() * mask).sum() / tokens
    return loss, metrics


def _pad(values: list[Tensor], device: torch.device) -> Tensor:
    """pad_field with ONE host-to-device copy (host tensors are padded on the host first)."""
    if all(v.device.type == "cpu" for v in values):
        return pad_field(values).to(device, non_blocking=True)
    return pad_field(values, device)


def update_critic(critic: nn.Module, optimizer: torch.optim.Optimizer, seqs: list[TrainSeq], cfg, grad_clip: float,
                  device: torch.device, n_minibatches: int, epochs: int, mb: MicroBatching, *,
                  loss_scale_factor: float) -> dict[str, float]:
    """Clipped value regression on the GAE returns (``cfg`` = CriticConfig); ``loss_scale_factor`` as in
    ``update_actor``."""
    sums: dict[str, float] = defaultdict(float)
    critic.train()
    for _ in range(epochs):
        for mini in _chunks(seqs, n_minibatches):
            gtok, gseq = _global_counts(mini)
            for micro in micro_batches(mini, mb):
                real = micro or [_DUMMY]
                pad = lambda name: _pad([getattr(s, name) for s in real], device)  # noqa: E731
                loss, m = value_loss(pad_field(forward_values(critic, real, device)), pad("old_values"), pad("returns"),
                                     pad("loss_mask"), cfg.cliprange_value, cfg.loss_agg_mode,
                                     global_token_count=gtok, global_seq_count=gseq,
                                     loss_scale_factor=loss_scale_factor)  # fmt: skip
                loss.backward()
                tokens = float(sum(s.loss_mask.sum() for s in micro))
                sums["vf_loss"] = sums["vf_loss"] + loss.detach()
                sums["vf_clipfrac"] = sums["vf_clipfrac"] + m["vf_clipfrac"] * tokens
                sums["_tokens"] += tokens
            sums["critic_grad_norm"] += _clip_and_step(critic, optimizer, grad_clip)
            sums["_steps"] += 1
    return _finish(sums)


def _finish(sums: dict[str, float | Tensor]) -> dict[str, float]:
    """Loss terms were normalised globally, so their sum over micro-batches is this rank's share;
    ratios are token-weighted."""
    steps, tokens = max(sums.pop("_steps", 1), 1), max(sums.pop("_tokens", 0), 1)
    out = {}
    for k, v in sums.items():
        v = float(v)  # the one host synchronisation of the metrics
        out[k] = v / steps if k in ("pg_loss", "kl_loss", "entropy", "vf_loss", "grad_norm", "critic_grad_norm") \
            else v / tokens
    return out
