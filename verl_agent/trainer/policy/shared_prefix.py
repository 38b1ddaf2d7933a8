"""Shared-prefix packing: sequences that start with the same tokens are run as ONE row, their common prefix once.

In GRPO the n samples of a prompt share it, and in agent work the prompt (system prompt, tool schemas, task)
is long; a multi-turn group can also share its first turns, and the segments after a context rewrite share
the task. A padded batch runs that prefix n times, forward and backward. Here a *pack* lays out

    [ prefix (P tokens) | suffix of sequence 1 | suffix of sequence 2 | ... ]

with position ids that restart at P for every suffix and a 4-D attention mask in which the prefix is causal
and each suffix sees the whole prefix and itself (causally), nothing of its siblings. Every position then
computes exactly what it computes in the sequence's own padded row (same tokens before it, same positions),
so log-probs, losses and gradients equal the unshared ones within float tolerance; the prefix's activations
receive the gradients of every suffix that reads them. The position that predicts a sequence's first suffix
token sits in the prefix and is read once per sequence, each with its own target.

Packs are cut from a micro-batch's (or mini-batch's) sequences by sorting them and walking their longest
common prefixes (`pack_sequences`); a sequence with no long enough shared prefix is a pack of its own, i.e.
its plain padded row. The layout needs a model that takes a custom 4-D mask and position ids on every layer
(`supports_packing`: sdpa or eager attention, no sliding-window layers); other models keep padded rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from verl_agent.trainer.policy.batch import TrainSeq

__all__ = ["Pack", "pack_sequences", "packed_batch", "supports_packing"]


@dataclass
class Pack:
    """Sequences run as one row: ``prefix_len`` tokens shared by all of them, then each one's own suffix."""

    seqs: list[TrainSeq]
    prefix_len: int

    @property
    def num_tokens(self) -> int:
        """Tokens of the packed row."""
        return self.prefix_len + sum(s.num_tokens - self.prefix_len for s in self.seqs)

    @property
    def saved_tokens(self) -> int:
        """Tokens the padded layout would run in addition: the prefix's repeats."""
        return self.prefix_len * (len(self.seqs) - 1)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def pack_sequences(seqs: list[TrainSeq], min_shared: int, max_tokens: int | None = None) -> list[Pack]:
    """Cut `seqs` into the packs that skip the most repeated tokens: each pack's members share at least
    `min_shared` leading tokens, and its row stays within `max_tokens` (a micro-batch's budget). The shared
    prefix stops at least one token before each member's end, so every member keeps a suffix of its own.

    Sorted by their tokens, sequences with a common prefix are neighbours, and a pack is a run of neighbours;
    the runs are chosen by dynamic programming on the tokens saved, (members - 1) x shared prefix, so that a
    prefix common to everything (a chat template's system turn) never swallows the groups' longer prompts.
    """
    ordered = sorted(seqs, key=lambda s: s.input_ids)
    n = len(ordered)
    lcp = [0] + [_common_prefix(ordered[k - 1].input_ids, ordered[k].input_ids) for k in range(1, n)]
    best, start = [0] * (n + 1), list(range(-1, n))  # best saving of ordered[:j], and where its last pack starts
    for j in range(1, n + 1):
        best[j], start[j] = best[j - 1], j - 1  # ordered[j-1] alone
        shared, total = ordered[j - 1].num_tokens - 1, ordered[j - 1].num_tokens
        for i in range(j - 2, -1, -1):  # the pack ordered[i:j]: the prefix only shrinks and the row only grows
            shared = min(shared, lcp[i + 1], ordered[i].num_tokens - 1)
            total += ordered[i].num_tokens
            if shared < max(min_shared, 1) or (max_tokens is not None and total - (j - 1 - i) * shared > max_tokens):
                break
            if best[i] + (j - 1 - i) * shared > best[j]:
                best[j], start[j] = best[i] + (j - 1 - i) * shared, i
    packs: list[Pack] = []
    j = n
    while j > 0:
        i = start[j]
        members = ordered[i:j]
        shared = min([lcp[k] for k in range(i + 1, j)] + [m.num_tokens - 1 for m in members]) \
            if len(members) > 1 else members[0].num_tokens  # a pack of one is the sequence's own row
        packs.append(Pack(members, shared))
        j = i
    return packs[::-1]


def packed_batch(packs: list[Pack], device: torch.device | str
                 ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, list[TrainSeq]]:  # fmt: skip
    """The model inputs of `packs` as [B, W] rows, one per pack, right-padded:

    input_ids [B, W], position_ids [B, W], attention_mask [B, 1, W, W] (bool, True = may attend), the flat
    indices (into B*W) of the positions that predict each sequence's response tokens, and the targets at them;
    sequences in pack order (the order the per-sequence outputs come back in).
    """
    width = -(-max(p.num_tokens for p in packs) // 8) * 8  # attention kernels want the mask's rows 8-aligned
    ids = torch.zeros(len(packs), width, dtype=torch.long)
    pos = torch.zeros(len(packs), width, dtype=torch.long)
    seg = torch.full((len(packs), width), -1, dtype=torch.long)  # 0 prefix, k>0 the k-th suffix, -1 padding
    rows, targets, order = [], [], []
    for b, p in enumerate(packs):
        P = p.prefix_len
        first = p.seqs[0].input_ids
        ids[b, :P] = torch.as_tensor(first[:P])
        pos[b, :P] = torch.arange(P)
        seg[b, :P] = 0
        at = P
        for k, s in enumerate(p.seqs, start=1):
            tail = s.input_ids[P:]
            ids[b, at : at + len(tail)] = torch.as_tensor(tail, dtype=torch.long)
            pos[b, at : at + len(tail)] = torch.arange(P, s.num_tokens)
            seg[b, at : at + len(tail)] = k
            # token t (t >= prompt_len) is predicted at sequence position t-1: in the prefix when t-1 < P
            t = torch.arange(s.prompt_len, s.num_tokens)
            rows.append(b * width + torch.where(t - 1 < P, t - 1, at + (t - 1 - P)))
            targets.append(torch.as_tensor(s.input_ids[s.prompt_len :], dtype=torch.long))
            order.append(s)
            at += len(tail)
    q, k = seg[:, :, None], seg[:, None, :]
    mask = (pos[:, None, :] <= pos[:, :, None]) & (k >= 0) & (q >= 0) & ((k == 0) | (k == q))
    mask |= torch.eye(width, dtype=torch.bool)  # a padding row attends to itself (no row without a key: no NaN)
    return (ids.to(device), pos.to(device), mask[:, None].to(device), torch.cat(rows).to(device),
            torch.cat(targets).to(device), order)


def supports_packing(model: nn.Module) -> bool:
    """Does every layer of `model` take the packed layout's 4-D mask and position ids as given?

    sdpa and eager attention use a custom 4-D mask as it is; flash-attention kernels take none, and models with
    sliding-window layers would apply the one mask to both kinds of layer.
    """
    conf = getattr(model, "config", None)
    if conf is None or getattr(conf, "_attn_implementation", None) not in ("sdpa", "eager"):
        return False
    if "sliding_attention" in (getattr(conf, "layer_types", None) or []):
        return False
    return not (getattr(conf, "use_sliding_window", False) and getattr(conf, "sliding_window", None))
