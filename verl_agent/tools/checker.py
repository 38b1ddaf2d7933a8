"""check_tool: run the BaseTool contract once on a user's tool, like gymnasium's check_env.

    from verl_agent.tools import check_tool
    check_tool(MyTool(config, schema), parameters={"query": "x"})

Raises ToolContractError naming the broken rule; returns what the calls produced.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from verl_agent.tools.base import BaseTool, ToolResponse
from verl_agent.tools.errors import ToolError
from verl_agent.tools.schema import JSONSchema, OpenAIFunctionToolSchema, validate_arguments

__all__ = ["ToolContractError", "check_tool", "check_tool_async", "example_arguments"]


class ToolContractError(ToolError, AssertionError):
    """A tool breaks the BaseTool contract; the message says which rule."""


def example_arguments(schema: JSONSchema | bool) -> Any:
    """A value that fits `schema` (defaults, first enum value, or a simple value of the type)."""
    if isinstance(schema, bool):  # `true` takes anything
        return "1"
    if "default" in schema.model_fields_set:
        return schema.default
    if schema.enum:
        return schema.enum[0]
    t = schema.type[0] if isinstance(schema.type, list) else schema.type
    if t == "object" or schema.properties:
        return {k: example_arguments(p) for k, p in (schema.properties or {}).items() if k in (schema.required or [])}
    if t == "array":
        items = schema.items if isinstance(schema.items, JSONSchema) else None
        return [example_arguments(items)] * max(1, schema.minItems or 0) if items else []
    return {"string": "1", "integer": 1, "number": 1.0, "boolean": True, "null": None}.get(t or "string", "1")


def _expect(cond: bool, msg: str) -> None:
    if not cond:
        raise ToolContractError(msg)


async def check_tool_async(
    tool: BaseTool,
    parameters: dict[str, Any] | None = None,
    create_kwargs: dict[str, Any] | None = None,
    execute_kwargs: dict[str, Any] | None = None,
    timeout: float = 30.0,
) -> dict[str, Any]:
    """Check schema, create (two instances, distinct ids), execute, calc_reward, release."""
    _expect(isinstance(tool, BaseTool), f"{tool!r} is not a BaseTool")
    schema = tool.get_openai_tool_schema()
    _expect(
        isinstance(schema, OpenAIFunctionToolSchema), "get_openai_tool_schema() must return OpenAIFunctionToolSchema"
    )
    _expect(tool.name == schema.function.name, f"tool.name {tool.name!r} != schema name {schema.function.name!r}")
    json.dumps(schema.to_openai())  # chat templates need a JSON-able schema
    params = parameters if parameters is not None else example_arguments(schema.function.parameters)
    params = validate_arguments(schema.function.parameters, params)
    a = await asyncio.wait_for(tool.create(None, **(create_kwargs or {})), timeout)
    b = await asyncio.wait_for(tool.create("check-fixed-id", **(create_kwargs or {})), timeout)
    a = a[0] if isinstance(a, tuple) else a  # verl >= 0.5 style
    b = b[0] if isinstance(b, tuple) else b
    _expect(isinstance(a, str) and a != "", f"create(None) must return a new instance id, got {a!r}")
    _expect(b == "check-fixed-id", f"create('check-fixed-id') must return that id, got {b!r}")
    try:
        out = await asyncio.wait_for(tool.execute(a, params, **(execute_kwargs or {})), timeout)
        _expect(
            isinstance(out, tuple) and len(out) == 3,
            f"execute must return (ToolResponse, reward, metrics), got {out!r}",
        )
        resp, reward, metrics = out
        _expect(isinstance(resp, ToolResponse), f"execute's response must be a ToolResponse, got {type(resp).__name__}")
        _expect(isinstance(resp.text, str), "ToolResponse.text must be a str")
        _expect(reward is None or isinstance(reward, (int, float)), f"step reward must be a number, got {reward!r}")
        _expect(isinstance(metrics, dict), f"metrics must be a dict, got {type(metrics).__name__}")
        final = await asyncio.wait_for(tool.calc_reward(a), timeout)
        _expect(isinstance(final, (int, float)), f"calc_reward must return a number, got {final!r}")
    finally:
        await tool.release(a)
        await tool.release(b)
    return {"instance_id": a, "response": resp, "step_reward": reward, "metrics": metrics, "reward": final}


def check_tool(tool: BaseTool, parameters: dict[str, Any] | None = None, **kwargs: Any) -> dict[str, Any]:
    """Synchronous check_tool_async (call check_tool_async from inside a running event loop)."""
    return asyncio.run(check_tool_async(tool, parameters, **kwargs))
