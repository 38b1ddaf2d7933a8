"""Exceptions raised by verl_agent.tools.

    ToolError                  base of everything below
    ├── ToolConfigError        load time: bad YAML, missing class, bad schema, duplicate name.
    │                          Also a ValueError. The message names the file and the entry.
    ├── ToolArgumentError      call time: arguments the model produced do not match the schema
    │                          (or a tool's `execute` refuses them, e.g. an MCP server's invalid-params).
    │                          The message is written for the model: ToolSession turns it into
    │                          the tool message "Error: <message>" (a policy failure: reward signal).
    └── ToolUnavailable        call time: the tool's own infrastructure failed (a sandbox that is down,
                               a service that answers 5xx). Raise it from `execute` with a `cause`;
                               the trajectory ends as an infrastructure failure (never reward).

Any other exception inside `execute`, and a timeout, is also an infrastructure failure
(cause "tool_crash" / "tool_timeout"): ToolSession reports it in `ToolResult.infra`, and
the agent loop ends that trajectory (never the others) and keeps it out of the loss.
What the model gets wrong (unknown tool, bad JSON, schema mismatch) stays a policy failure.
"""

from __future__ import annotations


class ToolError(Exception):
    """Base class of tool errors."""


class ToolConfigError(ToolError, ValueError):
    """A tool registry, schema or class cannot be loaded; raised before any rollout starts."""


class ToolArgumentError(ToolError, ValueError):
    """The model's arguments do not fit the tool schema; the message is shown to the model."""


class ToolUnavailable(ToolError, RuntimeError):
    """The tool's infrastructure failed (not the model's call); `cause` names it, e.g. "sandbox_unavailable"."""

    def __init__(self, message: str, cause: str = "tool_unavailable") -> None:
        super().__init__(message)
        self.cause = cause
