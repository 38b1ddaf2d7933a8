"""A plain calculator agent written against the official `openai` package; the loop knows nothing of verl-agent.

verl-agent calls `run_agent` once per trajectory with a base URL that records every token;
the same function runs unchanged against any OpenAI-compatible server:

    asyncio.run(run_agent({"messages": [{"role": "user", "content": "What is 12 * 37?"}]},
                          "http://localhost:8000/v1", "sk-...", model="my-model"))
"""

from __future__ import annotations

import json

from openai import AsyncOpenAI

MAX_TURNS = 3  # model calls per run (the calculator demo's multi_turn.max_assistant_turns)

# The same function schema as examples/calculator/tools.yaml, so both demos show the model the same prompt.
TOOLS = [{
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression and return the result.",
        "parameters": {
            "type": "object",
            "properties": {
                "expression": {"type": "string", "description": "The arithmetic expression, e.g. 37 * 12 + 5"},
            },
            "required": ["expression"],
        },
    },
}]  # fmt: skip



def calculator(expression: str) -> str:
    """The tool. It reuses the demo tool's safe evaluator so that both demos answer the model with the same
    text (the equivalence test relies on it); any Python function returning a string would do."""
    from verl_agent.tools.calculator import CalculatorError, evaluate, format_number

    try:
        return format_number(evaluate(str(expression)))
    except CalculatorError as e:
        return f"Error: {e}"


def run_tool(call) -> str:
    if call.function.name != "calculator":
        return f"Error: unknown tool {call.function.name!r}"
    try:
        args = json.loads(call.function.arguments or "{}")
    except json.JSONDecodeError as e:
        return f"Error: arguments are not JSON: {e}"
    return calculator(args.get("expression", "")) if isinstance(args, dict) else "Error: arguments must be an object"


async def run_agent(sample: dict, base_url: str, api_key: str, model: str = "policy") -> None:
    """Call the model, run the tools it asks for, stop on an answer without tool calls.

    Returns None: the run's reward comes from data.reward_fn on the model's last reply
    (return a number, or {"reward": x, ...}, to score it here instead).
    """
    # timeout: the SDK's default gives a connection 5 s; a trainer's CPU-bound rollout may take longer to accept
    client = AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=600.0)
    messages = list(sample["messages"])
    try:
        for turn in range(MAX_TURNS):
            response = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS)
            message = response.choices[0].message
            if not message.tool_calls or turn == MAX_TURNS - 1:
                return None
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id, "name": call.function.name,
                                 "content": run_tool(call)})  # fmt: skip
    finally:
        await client.close()
    return None
