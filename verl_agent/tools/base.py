"""BaseTool: the verl tool lifecycle, one instance serving many trajectories.

Contract (what the framework calls, and when)
---------------------------------------------
A tool object is built once per run from the tool YAML and shared by every
concurrent trajectory. Per-trajectory state lives under an *instance id*:

1. ``instance_id = await tool.create(instance_id, **create_kwargs)``
   once per trajectory, before the first call. Returns the id to use (a fresh
   uuid when ``instance_id`` is None). ``create_kwargs`` come from the dataset
   row's ``extra_info.tools_kwargs[<tool name>].create_kwargs`` (e.g. a ground truth).
2. ``response, step_reward, metrics = await tool.execute(instance_id, parameters, **execute_kwargs)``
   for each call the model makes. ``parameters`` were already validated against
   the tool's JSON Schema (defaults filled in); ``execute_kwargs`` come from the
   dataset row. Raising is allowed: the framework turns the exception into an
   ``Error: ...`` tool message; it never ends the trajectory. Calls are bounded by
   ``multi_turn.tool_timeout``; a tool must not block the event loop (use
   ``asyncio.to_thread`` for blocking work).
3. ``reward = await tool.calc_reward(instance_id, **calc_reward_kwargs)``
   optionally, at the end of the trajectory.
4. ``await tool.release(instance_id, **release_kwargs)`` exactly once per
   ``create``, also when the trajectory failed or was cancelled. Free the state here.

``verl_agent.tools.check_tool(tool)`` runs this lifecycle once on your tool.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from verl_agent.tools.errors import ToolConfigError
from verl_agent.tools.schema import OpenAIFunctionToolSchema

logger = logging.getLogger(__name__)

__all__ = ["BaseTool", "ToolResponse"]


@dataclass
class ToolResponse:
    """What a tool call returns to the model: text now, images later (kept for verl compatibility)."""

    text: str = ""
    image: list | None = None
    video: list | None = None


class BaseTool:
    """Base class of all tools; subclass and override `execute` (and the other hooks as needed).

    ``config`` is the entry's ``config`` mapping from the tool YAML (verl puts
    ``type: native`` there; it is kept as is). ``tool_schema`` is the entry's
    ``tool_schema``; a subclass may instead override ``get_openai_tool_schema``
    and accept ``tool_schema=None``.
    """

    def __init__(self, config: dict[str, Any] | None = None, tool_schema: OpenAIFunctionToolSchema | None = None):
        self.config: dict[str, Any] = dict(config or {})
        if isinstance(tool_schema, dict):
            tool_schema = OpenAIFunctionToolSchema.model_validate(tool_schema)
        self.tool_schema: OpenAIFunctionToolSchema | None = tool_schema
        self.tool_schema = self.get_openai_tool_schema()
        if self.tool_schema is None:
            raise ToolConfigError(
                f"{type(self).__name__}: no tool schema; pass `tool_schema` or override get_openai_tool_schema()"
            )
        self.name: str = self.tool_schema.function.name

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        """The schema shown to the model and used to validate its arguments."""
        return self.tool_schema  # type: ignore[return-value]

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> str:
        """Start per-trajectory state; return the instance id (a new uuid if none was given)."""
        return instance_id if instance_id is not None else str(uuid.uuid4())

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        """Run one call; return (response, step reward, metrics). Override this."""
        raise NotImplementedError(f"{type(self).__name__}.execute is not implemented")

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        """Trajectory-level reward from this tool's state (default 0.0)."""
        return 0.0

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        """Free the per-trajectory state; called once per `create`, also after errors."""
        return None

    async def shutdown(self) -> None:
        """Free what the tool holds for its whole process (a server, a container pool) when the worker that
        rolls out with it stops; called once, after every trajectory has ended."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


async def shutdown_tools(tools: Iterable[BaseTool]) -> None:
    """Each tool's `shutdown`; one tool's failure is logged and does not keep the others' resources alive."""
    for tool in tools:
        try:
            await tool.shutdown()
        except Exception:
            logger.exception("tool %r: shutdown failed", tool.name)
