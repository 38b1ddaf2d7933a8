"""Tool registry from YAML in verl's format.

    tools:
      - class_name: verl_agent.tools.calculator.CalculatorTool   # a BaseTool subclass
        config: {type: native}
        tool_schema:                                             # optional when the class has one
          type: function
          function: {name: calculator, description: ..., parameters: {...}}
      - class_name: my_tools.lookup             # a @tool function, or a plain typed function
      - class_name: tools/extra.py:lookup       # a file path (relative to this YAML) and a name

verl's built-in class paths load unchanged (``verl.tools.gsm8k_tool.Gsm8kTool``,
``verl.tools.search_tool.SearchTool``, ``verl.tools.sandbox_fusion_tools.SandboxFusionTool``,
``verl.tools.mcp_base_tool.MCPBaseTool``, ...): verl_agent.verl_compat maps them to ours; the ones we
have no equivalent for (image tools) are refused with "not supported yet". ``config.type`` is verl's
tool type: ``native`` (or absent), or ``mcp`` with an ``mcp:`` block: one entry then gives every tool
of its MCP servers (verl_agent.tools.mcp).

Everything is checked at load time: a missing module or class, a bad schema, a
duplicate tool name or an unknown key raises ToolConfigError naming the file and
the entry (index and class_name), before any rollout starts.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from verl_agent.tools.base import BaseTool
from verl_agent.tools.errors import ToolConfigError
from verl_agent.tools.function_tool import FunctionTool
from verl_agent.tools.schema import OpenAIFunctionToolSchema
from verl_agent.yaml_registry import Entry, YamlRegistry

__all__ = ["build_tools", "load_tools"]


def _check_entry(entry: Entry) -> None:
    """verl's tool types: native, or mcp with its 'mcp:' block (and no tool_schema: the servers give them)."""
    config_type = entry.config.get("type", "native")
    if config_type == "mcp" or "mcp" in entry.fields:
        if config_type != "mcp" or "mcp" not in entry.fields:
            raise ToolConfigError(f"{entry.where}: MCP tools need both config.type: mcp and an 'mcp:' block")
        if "tool_schema" in entry.fields:
            raise ToolConfigError(f"{entry.where}: an MCP entry takes no tool_schema (its servers list the tools)")
    elif config_type != "native":
        raise ToolConfigError(f"{entry.where}: config.type must be 'native' or 'mcp' (verl's tool types), "
                              f"got {config_type!r}")


def _make_tool(obj: Any, entry: Entry) -> BaseTool | list[BaseTool]:
    if entry.config.get("type") == "mcp":
        from verl_agent.tools.mcp import MCPTool, build_mcp_tools  # needs the optional `mcp` package

        if not (inspect.isclass(obj) and issubclass(obj, MCPTool)):
            raise ToolConfigError(f"config.type: mcp needs an MCP tool class (verl_agent.tools.mcp.MCPTool or "
                                  f"verl.tools.mcp_base_tool.MCPBaseTool), got {obj!r}")
        return list(build_mcp_tools(obj, entry.config, entry.fields["mcp"], entry.base_dir))
    schema = entry.fields.get("tool_schema")
    try:
        schema = OpenAIFunctionToolSchema.model_validate(schema) if schema is not None else None
    except ValidationError as e:
        raise ToolConfigError(f"invalid tool_schema:\n{e}") from e
    return _instantiate(obj, entry.config, schema)


def _instantiate(obj: Any, config: dict[str, Any], schema: OpenAIFunctionToolSchema | None) -> BaseTool:
    if isinstance(obj, FunctionTool):
        return obj.with_config(config, schema)
    if inspect.isclass(obj) and issubclass(obj, BaseTool):
        return obj(config, schema)
    if inspect.isclass(obj) and any(c.__name__ == "BaseTool" for c in obj.__mro__):
        # A verl tool (verl.tools.base_tool.BaseTool): same lifecycle, verl's own schema class.
        return _VerlToolAdapter(obj(config, _to_verl_schema(obj, schema)))
    if inspect.isfunction(obj) or inspect.iscoroutinefunction(obj):
        return FunctionTool(obj, config, schema)
    raise ToolConfigError(f"{obj!r} is neither a BaseTool subclass nor a function")


def _to_verl_schema(cls: type, schema: OpenAIFunctionToolSchema | None) -> Any:
    """verl validates its own pydantic schema class; hand it a plain dict re-parsed by that class."""
    if schema is None:
        return None
    mod = sys.modules.get(cls.__module__)
    verl_schema_cls = getattr(mod, "OpenAIFunctionToolSchema", None)
    return verl_schema_cls.model_validate(schema.to_openai()) if verl_schema_cls else schema


class _VerlToolAdapter(BaseTool):
    """Wraps a tool built on verl's own BaseTool so it speaks our schema type; the lifecycle is identical."""

    def __init__(self, inner: Any):
        self.inner = inner
        schema = inner.get_openai_tool_schema()
        dumped = schema.model_dump(exclude_none=True) if hasattr(schema, "model_dump") else schema
        super().__init__(getattr(inner, "config", {}), OpenAIFunctionToolSchema.model_validate(dumped))

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> Any:
        return await self.inner.create(instance_id, **kwargs)

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> Any:
        return await self.inner.execute(instance_id, parameters, **kwargs)

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return await self.inner.calc_reward(instance_id, **kwargs)

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        await self.inner.release(instance_id, **kwargs)


_TOOLS: YamlRegistry[BaseTool] = YamlRegistry(
    section="tools", kind="tool", keys=frozenset({"class_name", "config", "tool_schema", "mcp"}), error=ToolConfigError,
    make=_make_tool, check=_check_entry,
)


def build_tools(entries: Any, source: str = "<tools>", base_dir: Path | None = None) -> dict[str, BaseTool]:
    """Build tools from a list of verl-style entries; `source` names the file in errors."""
    return _TOOLS.build(entries, source, base_dir)


def load_tools(yaml_path: str | Path | None) -> dict[str, BaseTool]:
    """Load a verl tool YAML (`tools: [{class_name, config, tool_schema}]`); None or "" gives no tools."""
    return _TOOLS.load(yaml_path)
