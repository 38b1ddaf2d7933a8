"""Exceptions raised by verl_agent.tools.

    ToolError                  base of everything below
    ├── ToolConfigError        load time: bad YAML, missing class, bad schema, duplicate name.
    │                          Also a ValueError. The message names the file and the entry.
    └── ToolArgumentError      call time: arguments the model produced do not match the schema.
                               The message is written for the model: ToolSession turns it into
                               the tool message "Error: <message>".

A tool's own failures (exceptions inside `execute`, timeouts) are not wrapped in a
class here: ToolSession catches them per call and reports them to the model, so one
bad call never ends the trajectory.
"""

from __future__ import annotations


class ToolError(Exception):
    """Base class of tool errors."""


class ToolConfigError(ToolError, ValueError):
    """A tool registry, schema or class cannot be loaded; raised before any rollout starts."""


class ToolArgumentError(ToolError, ValueError):
    """The model's arguments do not fit the tool schema; the message is shown to the model."""
