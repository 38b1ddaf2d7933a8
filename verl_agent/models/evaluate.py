"""A small batched two-turn eval of the tiny model on calculator problems.

It really generates, parses tool calls with the hermes parser, runs the
calculator (safe AST evaluator) and generates the final answer: the rates it
reports are what the agent loop will see at the start of RL. It is kept tiny on
purpose; the project's agent loop lives in verl_agent/rollout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from verl_agent.chat import ChatEncoder
from verl_agent.models.calculator_task import CALCULATOR_TOOL_SCHEMA, calculator_reward, evaluate_expression, format_number
from verl_agent.parsers import get_parser
from verl_agent.protocol import Message

__all__ = ["Rates", "evaluate_rates"]


@dataclass
class Rates:
    """Fractions over held-out problems."""

    tool_call_rate: float  # first turn holds a parseable calculator call with an "expression"
    success_rate: float  # calculator_reward of the final answer
    n: int


@torch.no_grad()
def _generate(model: Any, prompts: list[list[int]], max_new: int, temperature: float, eos: list[int],
              pad: int) -> list[list[int]]:
    """Left-padded batched generation; returns the new ids of each row, cut after the first eos."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
    att = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0} if temperature > 0 else {
        "do_sample": False}
    out = model.generate(input_ids=ids, attention_mask=att, max_new_tokens=max_new, eos_token_id=eos,
                         pad_token_id=pad, **sampling)
    rows = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        rows.append(row[:cut])
    return rows


def _run_tool(call_args: dict[str, Any]) -> str:
    try:
        return format_number(evaluate_expression(call_args.get("expression", "")))
    except (ValueError, TypeError) as e:
        return f"Error: {e}"


def evaluate_rates(model: Any, tokenizer: Any, problems: list[dict[str, Any]], temperature: float = 1.0,
                   seed: int = 0, batch_size: int = 64, system_prompt: str | None = None,
                   tools: list[dict[str, Any]] | None = None) -> Rates:
    """Tool-call and success rates of `model` on `problems` (rows from make_problems); `system_prompt`:
    a system message before each question (default: none, the template's own); `tools`: the schemas the
    template lists (default: the built-in calculator's)."""
    enc = ChatEncoder(tokenizer, tools=tools or [CALCULATOR_TOOL_SCHEMA])
    parser = get_parser("hermes")
    eos, pad = enc.eos_token_ids, tokenizer.pad_token_id
    torch.manual_seed(seed)
    model.eval()
    calls = wins = 0
    for b in range(0, len(problems), batch_size):
        batch = problems[b : b + batch_size]
        system = [Message("system", system_prompt)] if system_prompt else []
        users = [[*system, Message("user", p["prompt"])] for p in batch]
        prompts = [enc.encode_prompt(u) for u in users]
        first = _generate(model, prompts, 48, temperature, eos, pad)
        finals = ["" for _ in batch]
        second_idx, second_prompts = [], []
        for i, gen in enumerate(first):
            parsed = parser.parse(tokenizer.decode(gen))
            call = next((c for c in parsed.tool_calls if c.name == "calculator"), None)
            if call is None or not isinstance(call.arguments.get("expression"), str) or gen[-1] not in eos:
                finals[i] = parsed.content
                continue
            calls += 1
            history = [*users[i], Message("assistant", parsed.content, parsed.tool_calls)]
            obs = enc.encode_observation(history, [Message("tool", _run_tool(call.arguments))])
            second_idx.append(i)
            second_prompts.append(prompts[i] + gen + obs)
        if second_prompts:
            for i, gen in zip(second_idx, _generate(model, second_prompts, 24, temperature, eos, pad)):
                finals[i] = parser.parse(tokenizer.decode(gen)).content
        wins += sum(calculator_reward("calculator", f, p["answer"]) for f, p in zip(finals, batch))
    n = max(1, len(problems))
    return Rates(tool_call_rate=calls / n, success_rate=wins / n, n=len(problems))
