"""MCP tools: verl's ``MCPBaseTool`` / ``MCPSearchTool`` YAML entries, served through the official `mcp` SDK.

    tools:
      - class_name: verl.tools.mcp_base_tool.MCPBaseTool    # or verl_agent.tools.mcp.MCPTool
        config: {type: mcp, timeout: 30, rate_limit: 10}
        mcp:
          mcp_servers_config_path: mcp_servers.json          # relative: next to this YAML, else the working dir
          tool_selected_list: [search, fetch]                 # optional: only these tools
          server_scope: worker                                # ours: worker (default) | trajectory

At load time every server of the file is started and its tools listed (all pages); each becomes one tool,
its ``inputSchema`` checked as a JSON Schema and used as the function's parameters, so arguments are
validated before the server sees them. ``timeout`` (seconds, default 30) bounds each call;
``rate_limit`` (default 10) is verl's: calls per second over all tools of the entry in one rollout
worker, a token bucket holding at most one second's calls.

``server_scope: worker`` keeps one connection per server per rollout worker (one process for a stdio
server), opened at load time; ``trajectory`` opens one per trajectory on its first call and closes it at
release. What the server returns is the tool message (text parts joined as verl joins them); a result
flagged ``isError`` is a model-facing ``Error: ...`` message, not an infrastructure failure. A server that
crashed or hung is replaced (see `verl_agent.tools.mcp_client`): a call to a tool it annotates read-only or
idempotent runs once more on the fresh server; any other call ends its trajectory as an infrastructure
failure with its cause.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from verl_agent.tools.base import BaseTool, ToolResponse
from verl_agent.tools.errors import ToolConfigError
from verl_agent.tools.mcp_client import (
    START_TIMEOUT,
    MCPServer,
    RateLimiter,
    load_servers,
    on_mcp_loop,
    run_on_mcp_loop,
)
from verl_agent.tools.schema import OpenAIFunctionToolSchema

__all__ = ["MCPSearchTool", "MCPTool", "build_mcp_tools"]

CONFIG_KEYS = frozenset({"type", "timeout", "rate_limit"})
MCP_KEYS = frozenset({"mcp_servers_config_path", "tool_selected_list", "server_scope"})


class MCPTool(BaseTool):
    """One tool of an MCP server; built by `build_mcp_tools` from a YAML entry (verl's MCPBaseTool)."""

    separator = " "  # between the text parts of a result, as verl's MCPBaseTool joins them

    def __init__(self, config: dict[str, Any] | None = None, tool_schema: OpenAIFunctionToolSchema | None = None,
                 server: MCPServer | None = None, idempotent: bool = False) -> None:
        if server is None or tool_schema is None:
            raise ToolConfigError(f"{type(self).__name__} is built from a tool YAML entry with an 'mcp:' block "
                                  "and config.type: mcp (docs/extending.md, MCP servers)")
        super().__init__(config, tool_schema)
        self.server = server
        self.idempotent = idempotent  # annotated read-only or idempotent: safe to call again after a restart

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> str:
        instance_id = instance_id or str(uuid.uuid4())
        await on_mcp_loop(self.server.open(instance_id))
        return instance_id

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
                      ) -> tuple[ToolResponse, float, dict[str, Any]]:
        result, retried = await on_mcp_loop(self.server.call(instance_id, self.name, parameters,
                                                             retry=self.idempotent))
        parts = [_part_text(p) for p in result.content or []]
        text = self.separator.join(parts)
        if not parts and result.structured_content is not None:
            text = json.dumps(result.structured_content, ensure_ascii=False)
        if result.is_error and not text.lower().startswith("error"):  # the model is told it failed
            text = f"Error: {text or 'the tool failed'}"
        # "mcp/retried": summed per trajectory and logged as rollout/mcp/retried (calls run again on a fresh server)
        return ToolResponse(text=text), 0.0, {**self._metrics(parts, bool(result.is_error)),
                                              "mcp/retried": float(retried)}

    def _metrics(self, parts: list[str], is_error: bool) -> dict[str, Any]:
        return {"mcp_is_error": is_error}

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        await on_mcp_loop(self.server.release(instance_id))

    async def shutdown(self) -> None:
        await on_mcp_loop(self.server.shutdown())


class MCPSearchTool(MCPTool):
    """verl's MCPSearchTool: text parts joined with nothing between them, and its search metrics."""

    separator = ""

    def _metrics(self, parts: list[str], is_error: bool) -> dict[str, Any]:
        return {"mcp_is_error": is_error, "status": "error" if is_error else "success", "total_results": len(parts)}


def _part_text(part: Any) -> str:
    """The model-facing text of one content block; media are named, not inlined."""
    kind = getattr(part, "type", "")
    if kind == "text":
        return part.text
    if kind == "resource":
        text = getattr(part.resource, "text", None)
        return text if text is not None else f"[resource {part.resource.uri}]"
    if kind == "resource_link":
        return f"[resource {part.uri}]"
    return f"[{kind} content ({getattr(part, 'mime_type', 'unknown type')}) not shown]"


def _require_sdk() -> None:
    try:
        from mcp import Client  # noqa: F401  (mcp 2's client API)
    except ImportError:
        raise ToolConfigError("MCP tools need the `mcp` package, version 2 or later: pip install "
                              "'verl-agent[mcp]'") from None


def _servers_file(path: Any, base_dir: Path | None) -> Path:
    if not isinstance(path, str) or not path:
        raise ToolConfigError("mcp.mcp_servers_config_path is required (the servers file, {\"mcpServers\": ...})")
    p = Path(path).expanduser()
    if not p.is_absolute() and base_dir is not None and (base_dir / p).exists():
        return base_dir / p
    return p


def _check_blocks(config: dict[str, Any], block: Any) -> tuple[float, float, list[str] | None, bool]:
    """(timeout, rate_limit, tool_selected_list, per_trajectory) from the entry's config and mcp blocks."""
    if not isinstance(block, dict):
        raise ToolConfigError(f"'mcp' must be a mapping with {sorted(MCP_KEYS)}, got {type(block).__name__}")
    for keys, got, name in ((CONFIG_KEYS, config, "config"), (MCP_KEYS, block, "mcp")):
        if set(got) - keys:
            raise ToolConfigError(f"unknown {name} key(s) {sorted(set(got) - keys)}; allowed: {sorted(keys)}")
    timeout, rate = _number(config, "timeout", 30.0), _number(config, "rate_limit", 10.0)
    selected = block.get("tool_selected_list")
    if selected is not None and not (isinstance(selected, list) and all(isinstance(s, str) for s in selected)):
        raise ToolConfigError(f"mcp.tool_selected_list must be a list of tool names, got {selected!r}")
    scope = block.get("server_scope", "worker")
    if scope not in ("worker", "trajectory"):
        raise ToolConfigError(f"mcp.server_scope must be 'worker' or 'trajectory', got {scope!r}")
    return timeout, rate, selected or None, scope == "trajectory"


def _number(config: dict[str, Any], key: str, default: float) -> float:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ToolConfigError(f"config.{key} must be a number > 0, got {value!r}")
    return float(value)


def build_mcp_tools(cls: type[MCPTool], config: dict[str, Any], block: Any,
                    base_dir: Path | None = None) -> list[MCPTool]:
    """Start the servers of the entry, list their tools and build one `cls` per (selected) tool."""
    _require_sdk()
    timeout, rate, selected, per_trajectory = _check_blocks(config, block)
    path = _servers_file(block.get("mcp_servers_config_path"), base_dir)
    limiter = RateLimiter(rate)  # shared by every tool of the entry, as verl shares one per process
    servers = [MCPServer(name, spec, timeout, limiter, per_trajectory) for name, spec in load_servers(path).items()]
    if not servers:
        raise ToolConfigError(f"MCP servers file {path}: every server is disabled")
    listed = run_on_mcp_loop(_list_all(servers), START_TIMEOUT + 4 * max(timeout, 30.0))
    try:
        tools = _make_tools(cls, config, servers, listed, selected, path)
    except BaseException:
        run_on_mcp_loop(_shutdown_all(servers), 30)
        raise
    used = {id(t.server) for t in tools}  # a server none of whose tools was selected is not kept running
    run_on_mcp_loop(_shutdown_all([s for s in servers if id(s) not in used]), 30)
    return tools


def _make_tools(cls: type[MCPTool], config: dict[str, Any], servers: list[MCPServer], listed: list[Any],
                selected: list[str] | None, path: Path) -> list[MCPTool]:
    tools: list[MCPTool] = []
    owner: dict[str, str] = {}
    for server, found in zip(servers, listed):
        if isinstance(found, BaseException):
            raise ToolConfigError(f"MCP server {server.name!r} ({path}): cannot list its tools: {found}")
        for t in found:
            if selected is not None and t.name not in selected:
                continue
            if t.name in owner:
                raise ToolConfigError(f"MCP tool {t.name!r} is offered by servers {owner[t.name]!r} and "
                                      f"{server.name!r}; pick one with mcp.tool_selected_list")
            owner[t.name] = server.name
            tools.append(cls(config, _schema(t, server.name), server=server, idempotent=_idempotent(t)))
    missing = sorted(set(selected or ()) - set(owner))
    if missing:
        raise ToolConfigError(f"mcp.tool_selected_list names {missing}, which no server of {path} offers "
                              f"(offered: {sorted(t.name for found in listed for t in found)})")
    if not tools:
        raise ToolConfigError(f"the servers of {path} offer no tools")
    return tools


async def _list_all(servers: list[MCPServer]) -> list[Any]:
    return await asyncio.gather(*(s.list_tools() for s in servers), return_exceptions=True)


async def _shutdown_all(servers: list[MCPServer]) -> None:
    await asyncio.gather(*(s.shutdown() for s in servers), return_exceptions=True)


def _idempotent(tool: Any) -> bool:
    """Does the server annotate the tool as read-only or idempotent (MCP ToolAnnotations hints)?"""
    hints = getattr(tool, "annotations", None)
    return bool(hints is not None and (hints.read_only_hint or hints.idempotent_hint))


def _schema(tool: Any, server: str) -> OpenAIFunctionToolSchema:
    """The MCP tool as an OpenAI function; its inputSchema must be a valid JSON Schema of an object."""
    fn = {"name": tool.name, "description": tool.description or "", "parameters": dict(tool.input_schema or {})}
    try:
        return OpenAIFunctionToolSchema.model_validate({"type": "function", "function": fn})
    except ValidationError as e:
        raise ToolConfigError(f"MCP server {server!r}, tool {tool.name!r}: unusable schema:\n{e}") from None
