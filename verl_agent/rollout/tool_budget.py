"""The prompt tokens the tools take: the chat template renders every tool's schema into every prompt.

`verl-agent tools list CONFIG` prints each tool's share and the longest prompt of the run's data with the
whole tool block, and warns when that passes data.max_prompt_length: every such prompt would end as
`prompt_too_long` (filtered or an infrastructure failure) before training says anything.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from verl_agent.chat import ChatEncoder
from verl_agent.config import RunConfig
from verl_agent.data import iter_samples
from verl_agent.protocol import Message

__all__ = ["SCAN_LIMIT", "PromptBudget", "prompt_budget", "tool_tokens"]

SCAN_LIMIT = 10_000  # samples read per data file: enough for the longest prompt of a typical set, and quick
_PROBE = [Message(role="user", content="x")]


def tool_tokens(tokenizer: Any, schemas: list[dict[str, Any]]) -> int:
    """Tokens `schemas` (OpenAI tool dicts) add to a prompt under the tokenizer's chat template."""
    return len(ChatEncoder(tokenizer, schemas).encode_prompt(_PROBE)) - len(ChatEncoder(tokenizer).encode_prompt(_PROBE))


@dataclass
class PromptBudget:
    """Per-tool and whole-block token counts, and the prompts of the data measured with the block."""

    limit: int  # data.max_prompt_length
    per_tool: dict[str, int] = field(default_factory=dict)
    block: int = 0
    scanned: int = 0  # prompts measured (at most SCAN_LIMIT per file)
    over: int = 0  # of them, those longer than `limit` with the tools
    longest: int = 0
    longest_uid: str = ""


def prompt_budget(cfg: RunConfig, tokenizer: Any, schemas: dict[str, dict[str, Any]]) -> PromptBudget:
    """Measure the tools `schemas` (name -> OpenAI tool dict) against the prompts of data.train_files and
    data.val_files (the interaction's first message, added at run time, is not counted)."""
    d = cfg.data
    out = PromptBudget(limit=d.max_prompt_length, block=tool_tokens(tokenizer, list(schemas.values())),
                       per_tool={name: tool_tokens(tokenizer, [s]) for name, s in schemas.items()})
    encoder = ChatEncoder(tokenizer, list(schemas.values()) or None)
    for path in [*d.train_files, *d.val_files]:
        rows = iter_samples(path, prompt_key=d.prompt_key, answer_key=d.answer_key, skip_bad_rows=True)
        for sample in itertools.islice(rows, SCAN_LIMIT):
            n = len(encoder.encode_prompt(sample.messages))
            out.scanned += 1
            out.over += n > out.limit
            if n > out.longest:
                out.longest, out.longest_uid = n, sample.uid
    return out
