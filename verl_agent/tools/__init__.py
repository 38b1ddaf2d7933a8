"""Tools: BaseTool, OpenAI function schemas, the YAML registry, @tool, built-in tools.

The sandbox code tool lives in verl_agent.tools.sandbox_fusion (imported lazily,
it needs the sandbox client): `class_name: verl_agent.tools.sandbox_fusion.SandboxFusionTool`.
MCP tools (verl_agent.tools.mcp, the optional `mcp` package) come from YAML entries with an `mcp:` block.
"""

from verl_agent.tools.base import BaseTool, ToolResponse
from verl_agent.tools.calculator import CalculatorTool
from verl_agent.tools.checker import ToolContractError, check_tool, check_tool_async
from verl_agent.tools.errors import ToolArgumentError, ToolConfigError, ToolError
from verl_agent.tools.function_tool import FunctionTool, function_schema, tool
from verl_agent.tools.registry import build_tools, load_tools
from verl_agent.tools.schema import (
    JSONSchema,
    OpenAIFunctionParametersSchema,
    OpenAIFunctionSchema,
    OpenAIFunctionToolSchema,
    validate_arguments,
)
from verl_agent.tools.session import ToolResult, ToolSession

__all__ = [
    "BaseTool",
    "CalculatorTool",
    "FunctionTool",
    "JSONSchema",
    "OpenAIFunctionParametersSchema",
    "OpenAIFunctionSchema",
    "OpenAIFunctionToolSchema",
    "ToolArgumentError",
    "ToolConfigError",
    "ToolContractError",
    "ToolError",
    "ToolResponse",
    "ToolResult",
    "ToolSession",
    "build_tools",
    "check_tool",
    "check_tool_async",
    "function_schema",
    "load_tools",
    "tool",
    "validate_arguments",
]


def __getattr__(name: str) -> type:
    # The sandbox code tool needs the sandbox client, MCP tools their module: import them only when asked for.
    if name == "SandboxFusionTool":
        from verl_agent.tools.sandbox_fusion import SandboxFusionTool

        return SandboxFusionTool
    if name in ("MCPTool", "MCPSearchTool"):
        from verl_agent.tools import mcp

        return getattr(mcp, name)
    raise AttributeError(f"module 'verl_agent.tools' has no attribute {name!r}")
