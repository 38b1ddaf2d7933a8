"""Tokenizer training and the supervised warm start of the tiny model."""

from __future__ import annotations

import inspect
import math
import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from verl_agent.chat import ChatEncoder
from verl_agent.models.sft_data import conversation, decision_rates, encode_conversation, tool_variants
from verl_agent.models.tokenizer import train_tokenizer

if TYPE_CHECKING:
    from verl_agent.models.tiny_settings import TinySettings

__all__ = ["group_by_prefix", "make_dataset", "shared_prefix_loss", "train"]

Groups = list[tuple[list[int], list[tuple[list[int], list[int]]]]]  # (system-turn ids, [(ids, loss mask)])
_EXTRA_TEXT = [  # a little general text so that user feedback outside the task still tokenizes compactly
    "Hello! How can I help you today?", "Thank you, that is correct.", "That is wrong, please try again.",
    "Please answer the question.", "Here is the result of the tool call.", "Error: division by zero",
]


def make_dataset(problems: list[dict[str, Any]], s: TinySettings, seed: int) -> tuple[Any, Groups]:
    """Train the tokenizer on the rendered chats, then encode them as (ids, loss mask) grouped by system turn."""
    rng = random.Random(seed)
    variants = tool_variants()
    p_tool, p_direct = decision_rates(s.tool_fraction, s.tool_call_prior)
    chats = []
    for p in problems:
        use_tool = rng.random() < s.tool_fraction
        train_decision = rng.random() < (p_tool if use_tool else p_direct)
        chats.append((rng.randrange(len(variants)), conversation(p, use_tool, rng), train_decision))
    boot = train_tokenizer(_EXTRA_TEXT, vocab_size=300)  # only its chat template is used, to render text
    boot_encs = [ChatEncoder(boot, tools=v) for v in variants]
    corpus = [boot_encs[v].render(msgs, add_generation_prompt=False) for v, msgs, _ in chats[:2000]] + _EXTRA_TEXT * 20
    tokenizer = train_tokenizer(corpus, vocab_size=s.vocab_size)
    encs = [ChatEncoder(tokenizer, tools=v) for v in variants]
    data = [encode_conversation(encs[v], msgs, train) for v, msgs, train in chats]
    return tokenizer, group_by_prefix(data, tokenizer.convert_tokens_to_ids("<|im_end|>"))


def group_by_prefix(data: list[tuple[list[int], list[int]]], split_id: int) -> Groups:
    """Split each chat after its system turn (the first `split_id` + newline) and group equal prefixes.

    All chats of a group share the system prompt and tool schemas (most of their tokens); training runs
    that prefix once per batch instead of once per row.
    """
    groups: dict[tuple[int, ...], list[tuple[list[int], list[int]]]] = {}
    for ids, mask in data:
        cut = ids.index(split_id) + 2
        assert not any(mask[:cut]), "the system turn must not be trained on"
        groups.setdefault(tuple(ids[:cut]), []).append((ids[cut:], mask[cut:]))
    return [(list(k), v) for k, v in groups.items()]


def _suffix_batch(rows: list[tuple[list[int], list[int]]], pad: int) -> tuple[torch.Tensor, ...]:
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    att = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (seq, mask) in enumerate(rows):  # right padding: pads come after every real token
        n = len(seq)
        ids[i, :n] = torch.tensor(seq)
        att[i, :n] = 1
        labels[i, :n] = torch.tensor([t if m else -100 for t, m in zip(seq, mask)])
    return ids, att, labels


def shared_prefix_loss(model: Any, prefix: list[int], rows: list[tuple[list[int], list[int]]]) -> torch.Tensor:
    """Mean loss on the rows' masked tokens, each row read as `prefix + row`; the prefix runs once."""
    from transformers import DynamicCache

    dev = model.device
    ids, att, labels = (t.to(dev) for t in _suffix_batch(rows, model.config.pad_token_id))
    b = ids.shape[0]
    out = model(input_ids=torch.tensor([prefix], device=dev), use_cache=True)
    pre = out.cache if "cache" in out else out.past_key_values  # renamed in transformers 5.2x
    cache = DynamicCache([(layer.keys.expand(b, -1, -1, -1), layer.values.expand(b, -1, -1, -1))
                          for layer in pre.layers])
    full_att = torch.cat([torch.ones((b, len(prefix)), dtype=att.dtype, device=dev), att], dim=1)
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    return model(input_ids=ids, attention_mask=full_att, labels=labels, **{key: cache}).loss


def train(model: Any, groups: Groups, s: TinySettings, seed: int,
          on_step: Callable[[int, list[float]], None] | None = None) -> list[float]:
    """AdamW with warmup + cosine decay on assistant tokens only; returns the loss per step.

    `on_step(step, losses)` runs after every update (1-based step), e.g. to evaluate along the way.
    """
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.01, betas=(0.9, 0.98))

    def lr_at(step: int) -> float:
        if step < s.warmup_steps:
            return (step + 1) / s.warmup_steps
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * (step - s.warmup_steps) / max(1, s.steps - s.warmup_steps)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    sizes = torch.tensor([len(rows) for _, rows in groups], dtype=torch.float)
    model.train()
    losses = []
    bar = tqdm(range(s.steps), desc="SFT", leave=False, mininterval=2.0)
    for _ in bar:
        prefix, rows = groups[int(torch.multinomial(sizes, 1, generator=gen))]
        idx = torch.randint(len(rows), (s.batch_size,), generator=gen).tolist()
        loss = shared_prefix_loss(model, prefix, [rows[i] for i in idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
        if on_step is not None:
            on_step(len(losses), losses)
    model.eval()
    return losses
