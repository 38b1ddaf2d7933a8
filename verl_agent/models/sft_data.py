"""Synthetic calculator conversations for the tiny model's warm start, as (ids, loss mask).

Two kinds are mixed: the assistant calls the calculator and copies its result
("The answer is 449."), or it answers straight away from "mental math", which a
model this small gets wrong on multi-digit problems. Most chats use the tool, so
the model gets much practice at copying (the expression into the call, the
result into the answer), but the call-or-answer decision is trained on a
balanced subset (decision_rates): after SFT the policy calls the tool only part
of the time, so RL has a clear signal: calling the tool raises the reward.
"""

from __future__ import annotations

import copy
import random
from typing import Any

from verl_agent.chat import ChatEncoder
from verl_agent.models.calculator_task import (
    CALCULATOR_TOOL_SCHEMA,
    SYSTEM_PROMPT,
    evaluate_expression,
    format_number,
)
from verl_agent.protocol import Message, ToolCall

__all__ = ["conversation", "decision_rates", "encode_conversation", "tool_variants"]

_DESCRIPTIONS = [
    "Evaluate an arithmetic expression and return the result.",
    "A calculator. Returns the value of a math expression.",
    "Compute the numeric value of an expression with + - * / and parentheses.",
    "Calculator tool.",
]
_ARG_DESCRIPTIONS = [None, "The expression, e.g. 37 * 12 + 5", "Arithmetic expression to evaluate.", "Math expression"]
_SYSTEMS = [None, None, SYSTEM_PROMPT, "You are a helpful assistant."]


def tool_variants() -> list[list[dict[str, Any]]]:
    """Calculator schemas with different descriptions, so the model does not depend on one wording."""
    out = []
    for d in _DESCRIPTIONS:
        for a in _ARG_DESCRIPTIONS:
            schema = copy.deepcopy(CALCULATOR_TOOL_SCHEMA)
            schema["function"]["description"] = d
            prop = schema["function"]["parameters"]["properties"]["expression"]
            prop.pop("description", None)
            if a is not None:
                prop["description"] = a
            out.append([schema])
    return [[CALCULATOR_TOOL_SCHEMA], *out]


def conversation(problem: dict[str, Any], use_tool: bool, rng: random.Random) -> list[Message]:
    """One chat: [system] user question, then either tool call + result + answer, or a direct answer."""
    system = rng.choice(_SYSTEMS)
    msgs = [Message("system", system)] if system else []
    msgs.append(Message("user", problem["prompt"]))
    if use_tool:
        result = format_number(evaluate_expression(problem["expression"]))
        call = ToolCall(name="calculator", arguments={"expression": problem["expression"]})
        msgs += [Message("assistant", "", [call]), Message("tool", result, name="calculator")]
        answer = result
    else:
        answer = _mental_math(problem, rng)
    msgs.append(Message("assistant", f"The answer is {answer}."))
    return msgs


def _mental_math(problem: dict[str, Any], rng: random.Random) -> str:
    """A direct answer as a model this small would give it: right for easy sums, usually off otherwise.

    Training direct answers on the true result would teach the model to guess the arithmetic (it cannot),
    which competes with copying the calculator's result; a noisy answer leaves copying as the only way to
    be right, which is the behaviour RL should then reinforce.
    """
    true = evaluate_expression(problem["expression"])
    if rng.random() < 0.15:
        return format_number(true)
    off = max(1, int(abs(true) * rng.uniform(0.01, 0.2))) if isinstance(true, int) else abs(true) * 0.1 + 1
    return format_number(true + rng.choice([-1, 1]) * (off if isinstance(true, int) else round(off, 2)))


def decision_rates(tool_fraction: float, tool_call_prior: float) -> tuple[float, float]:
    """(p_tool, p_direct): the chance that a tool / direct chat trains its first assistant token.

    That token decides between calling the calculator and answering. Training it on the rates returned
    here makes the model call with probability `tool_call_prior`, while the skill after the call is
    trained on every tool chat (`tool_fraction` of them): much copying practice, a modest call rate.
    """
    f, p = tool_fraction, tool_call_prior
    if not (0 < f < 1 and 0 < p < 1):
        raise ValueError(f"tool_fraction and tool_call_prior must be in (0, 1), got {f} and {p}")
    if p <= f:
        return p * (1 - f) / (f * (1 - p)), 1.0
    return 1.0, f * (1 - p) / (p * (1 - f))


def encode_conversation(enc: ChatEncoder, msgs: list[Message], train_decision: bool = True) -> tuple[list[int], list[int]]:
    """Ids and loss mask (1 on assistant tokens) built exactly as the agent loop builds them.

    `train_decision=False` masks out the first assistant token (call the tool or answer: see decision_rates).
    """
    first = next(i for i, m in enumerate(msgs) if m.role == "assistant")
    ids = enc.encode_prompt(msgs[:first])
    mask = [0] * len(ids)
    i = first
    while i < len(msgs):
        gen = enc.encode_assistant(msgs[:i], msgs[i])
        ids += gen
        mask += [1] * len(gen)
        if i == first and not train_decision:
            mask[len(ids) - len(gen)] = 0
        j = i + 1
        while j < len(msgs) and msgs[j].role != "assistant":
            j += 1
        if j > i + 1:
            obs = enc.encode_observation(msgs[: i + 1], msgs[i + 1 : j])
            ids += obs
            mask += [0] * len(obs)
        i = j
    return ids, mask
