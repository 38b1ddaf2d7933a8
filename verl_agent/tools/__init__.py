"""Tools: BaseTool, OpenAI function schemas, the YAML registry, @tool, built-in tools."""

from verl_agent.tools.base import BaseTool, ToolResponse
from verl_agent.tools.errors import ToolArgumentError, ToolConfigError, ToolError
from verl_agent.tools.schema import (
    JSONSchema,
    OpenAIFunctionParametersSchema,
    OpenAIFunctionSchema,
    OpenAIFunctionToolSchema,
    validate_arguments,
)

__all__ = [
    "BaseTool",
    "JSONSchema",
    "OpenAIFunctionParametersSchema",
    "OpenAIFunctionSchema",
    "OpenAIFunctionToolSchema",
    "ToolArgumentError",
    "ToolConfigError",
    "ToolError",
    "ToolResponse",
    "validate_arguments",
]
