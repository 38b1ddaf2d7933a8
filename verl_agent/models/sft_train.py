"""Tokenizer training and the supervised warm start of the tiny model."""

from __future__ import annotations

import math
import random
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from verl_agent.chat import ChatEncoder
from verl_agent.models.sft_data import conversation, encode_conversation, tool_variants
from verl_agent.models.tokenizer import train_tokenizer

if TYPE_CHECKING:
    from verl_agent.models.tiny import TinySettings

__all__ = ["make_dataset", "train"]

_EXTRA_TEXT = [  # a little general text so that user feedback outside the task still tokenizes compactly
    "Hello! How can I help you today?", "Thank you, that is correct.", "That is wrong, please try again.",
    "Please answer the question.", "Here is the result of the tool call.", "Error: division by zero",
]


def make_dataset(problems: list[dict[str, Any]], s: TinySettings, seed: int) -> tuple[Any, list[tuple]]:
    """Train the tokenizer on the rendered chats, then encode them as (ids, loss mask)."""
    rng = random.Random(seed)
    variants = tool_variants()
    chats = [(rng.randrange(len(variants)), conversation(p, rng.random() < s.tool_fraction, rng)) for p in problems]
    boot = train_tokenizer(_EXTRA_TEXT, vocab_size=300)  # only its chat template is used, to render text
    boot_encs = [ChatEncoder(boot, tools=v) for v in variants]
    corpus = [boot_encs[v].render(msgs, add_generation_prompt=False) for v, msgs in chats[:2000]] + _EXTRA_TEXT * 20
    tokenizer = train_tokenizer(corpus, vocab_size=s.vocab_size)
    encs = [ChatEncoder(tokenizer, tools=v) for v in variants]
    return tokenizer, [encode_conversation(encs[v], msgs) for v, msgs in chats]


def _batch(rows: list[tuple[list[int], list[int]]], pad: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    att = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (seq, mask) in enumerate(rows):  # right padding: training needs no generation prompt alignment
        n = len(seq)
        ids[i, :n] = torch.tensor(seq)
        att[i, :n] = 1
        labels[i, :n] = torch.tensor([t if m else -100 for t, m in zip(seq, mask)])
    return ids, att, labels


def train(model: Any, data: list[tuple[list[int], list[int]]], s: TinySettings, seed: int) -> list[float]:
    """AdamW with warmup + cosine decay on assistant tokens only; returns the loss per step."""
    gen = torch.Generator().manual_seed(seed)
    pad = model.config.pad_token_id
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.01, betas=(0.9, 0.98))

    def lr_at(step: int) -> float:
        if step < s.warmup_steps:
            return (step + 1) / s.warmup_steps
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * (step - s.warmup_steps) / max(1, s.steps - s.warmup_steps)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    model.train()
    losses = []
    bar = tqdm(range(s.steps), desc="tiny model SFT", leave=False, mininterval=2.0)
    for _ in bar:
        idx = torch.randint(len(data), (s.batch_size,), generator=gen).tolist()
        ids, att, labels = (t.to(model.device) for t in _batch([data[i] for i in idx], pad))
        loss = model(input_ids=ids, attention_mask=att, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
    model.eval()
    return losses
