"""`verl-agent model check-template MODEL`: does a chat template let the trainer append tokens turn by turn?

A multi-turn tool conversation (with reasoning, two tool calls, a user follow-up) is rendered two ways:
by the template in full, and by incremental append (the prompt; then, per assistant turn, what the
template adds for the reply after the generation prompt; then what it adds for the tool results / user
message and the next generation prompt). Every step at which the template rewrote text it had already
rendered is a drift, named by what changed:

- ``dropped reasoning``: an earlier turn's reasoning disappears (Qwen3, GLM-4.5, gpt-oss templates);
- ``missing generation prompt``: the assistant message does not start as the generation prompt did;
- ``re-ordered tool results``, ``whitespace``, ``rewritten history``: the other ways text changes;
- ``token merge``: same text, different tokens (no special token between turns).

Any drift means `multi_turn.history: exact` cannot be token-exact: use `template`. The tool-call format
detected from the template (parsers.detect_format) is the parser to use.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from verl_agent.chat import ChatEncoder
from verl_agent.parsers import detect_format
from verl_agent.protocol import Message, ToolCall

__all__ = ["Drift", "TemplateReport", "check_template", "conversation"]

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate an arithmetic expression.",
          "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                         "required": ["expression"]}}}]  # fmt: skip


def conversation() -> list[Message]:
    """The conversation checked: reasoning before each reply, two tool turns, then a user follow-up."""
    call = ToolCall("calculator", {"expression": "12*37"}, id="functions.calculator:0")
    call2 = ToolCall("calculator", {"expression": "444+1"}, id="functions.calculator:1")
    return [
        Message(role="user", content="What is 12 * 37?"),
        Message(role="assistant", content="", tool_calls=[call], reasoning_content="I should use the calculator."),
        Message(role="tool", content="444", tool_call_id=call.id, name="calculator"),
        Message(role="assistant", content="12 * 37 = 444.", reasoning_content="The tool says 444."),
        Message(role="user", content="And one more?"),
        Message(role="assistant", content="", tool_calls=[call2], reasoning_content="Add one."),
        Message(role="tool", content="445", tool_call_id=call2.id, name="calculator"),
        Message(role="assistant", content="445.", reasoning_content="Done."),
    ]


@dataclass
class Drift:
    kind: str
    step: str  # which append it happened at
    char: int  # first differing character of the earlier rendering
    before: str
    after: str


@dataclass
class TemplateReport:
    format: str
    drifts: list[Drift] = field(default_factory=list)
    full_tokens: int = 0
    incremental_tokens: int = 0
    first_token_diff: int | None = None

    @property
    def history(self) -> str:
        """The `multi_turn.history` this template needs."""
        return "template" if self.drifts else "exact"


def _classify(old: str, new: str, messages: list[Message]) -> str:
    if "".join(old.split()) == "".join(new[: len(old) + 64].split())[: len("".join(old.split()))]:
        return "whitespace"
    lost = [m.reasoning_content for m in messages if m.reasoning_content and m.reasoning_content in old]
    if any(r not in new for r in lost):
        return "dropped reasoning"
    results = [m.content for m in messages if m.role == "tool" and m.content in old]
    if results and all(r in new for r in results) and \
            sorted(results, key=old.index) != sorted(results, key=new.index):
        return "re-ordered tool results"
    return "rewritten history"


def _append(pieces: list[str], report: TemplateReport, old: str, new: str, step: str, msgs: list[Message]) -> None:
    """Append what `new` adds after `old`; when `new` does not start with `old`, record the drift."""
    if new.startswith(old):
        pieces.append(new[len(old):])
        return
    i = next((k for k in range(min(len(old), len(new))) if old[k] != new[k]), min(len(old), len(new)))
    kind = "missing generation prompt" if step.startswith("reply") else _classify(old, new, msgs)
    report.drifts.append(Drift(kind, step, i, old[max(0, i - 40): i + 40], new[max(0, i - 40): i + 40]))
    pieces.append(new[i:] if len(new) > i else "")  # continue from the point of divergence


def check_template(tokenizer: Any, messages: list[Message] | None = None) -> TemplateReport:
    """Render `messages` (default: `conversation()`) in full and by incremental append; see the module docstring."""
    messages = messages or conversation()
    enc = ChatEncoder(tokenizer, tools=TOOLS)
    report = TemplateReport(format=detect_format(tokenizer))
    first = next(i for i, m in enumerate(messages) if m.role == "assistant")
    prompt = enc.render(messages[:first], add_generation_prompt=True)
    pieces, rendered = [prompt], prompt
    for k in range(first, len(messages)):
        if messages[k].role != "assistant":
            continue
        done = enc.render(messages[: k + 1], add_generation_prompt=False)
        _append(pieces, report, rendered, done, f"reply {k}", messages[: k + 1])
        nxt = next((j for j in range(k + 1, len(messages)) if messages[j].role == "assistant"), None)
        if nxt is None:
            break
        rendered = enc.render(messages[:nxt], add_generation_prompt=True)
        _append(pieces, report, done, rendered, f"messages {k + 1}..{nxt - 1}", messages[:nxt])
    full = enc.encode_text(enc.render(messages, add_generation_prompt=False))
    incremental = [i for p in pieces for i in enc.encode_text(p)]
    report.full_tokens, report.incremental_tokens = len(full), len(incremental)
    diff = next((i for i, (a, b) in enumerate(zip(full, incremental)) if a != b), None)
    if diff is None and len(full) != len(incremental):
        diff = min(len(full), len(incremental))
    report.first_token_diff = diff
    if diff is not None and not report.drifts:
        report.drifts.append(Drift("token merge", "whole conversation", diff, tokenizer.decode(full[diff: diff + 8]),
                                   tokenizer.decode(incremental[diff: diff + 8])))  # fmt: skip
    return report


def format_report(report: TemplateReport, tokenizer: Any) -> str:
    lines = [f"tool-call format: {report.format} (multi_turn.format={report.format})",
             f"tokens: {report.full_tokens} rendered in full, {report.incremental_tokens} appended turn by turn"
             + ("" if report.first_token_diff is None else f"; first different token at {report.first_token_diff}")]
    for d in report.drifts:
        lines.append(f"DRIFT {d.kind} at {d.step}, char {d.char}:\n  before: {d.before!r}\n  after:  {d.after!r}")
    verdict = ("no drift: appending tokens equals the template's rendering" if not report.drifts else
               "the template rewrites earlier turns: exact appending trains on contexts it never renders")
    lines.append(f"{verdict}; recommended multi_turn.history={report.history}")
    return "\n".join(lines)


def add_cli(subparsers: Any) -> None:
    """Register `model check-template MODEL`."""
    p = subparsers.add_parser("check-template", help="render a multi-turn tool conversation in full and by "
                              "incremental append; name any drift and the history/format settings to use")
    p.add_argument("model", help="a model folder or hub name (its tokenizer and chat template are read)")
    p.add_argument("--chat-template", default=None, help="a .jinja file to check instead of the model's own")
    p.set_defaults(func=run_cli)


def run_cli(args: argparse.Namespace) -> int:
    """Prints the report; exit status 0 without drift, 1 with drift."""
    from pathlib import Path

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if args.chat_template:
        tokenizer.chat_template = Path(args.chat_template).read_text()
    report = check_template(tokenizer)
    print(format_report(report, tokenizer))
    return 1 if report.drifts else 0
