"""An MCP server for tests/tools/test_mcp.py, written with the `mcp` SDK's MCPServer (FastMCP before mcp 2):
served over stdio when run as a script, over streamable HTTP through `server.streamable_http_app()`."""

from __future__ import annotations

import asyncio
import os
from typing import Annotated, Literal

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import ToolAnnotations
from pydantic import BaseModel, Field

server = MCPServer("verl-agent-test", log_level="WARNING")  # quiet: the tests read results, not logs


class Point(BaseModel):
    x: int
    y: int


@server.tool(annotations=ToolAnnotations(read_only_hint=True))  # retried once on a fresh server after a hang
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def distance(p: Point, norm: Literal["l1", "max"] = "l1") -> int:
    """Distance of a point from the origin."""
    return abs(p.x) + abs(p.y) if norm == "l1" else max(abs(p.x), abs(p.y))


@server.tool()
def code(value: Annotated[str, Field(pattern=r"^[A-Z]{3}$")]) -> str:
    """Look up a three-letter code."""
    return f"code {value}"


@server.tool()
def refuse(record: str) -> str:
    """Fetch a record (there are none)."""
    raise ToolError(f"no such record: {record}")


@server.tool()
async def slow(seconds: float) -> str:
    """Answer after `seconds`."""
    await asyncio.sleep(seconds)
    return "done"


@server.tool()
def pid() -> int:
    """The server's process id."""
    return os.getpid()


@server.tool()
def label() -> str:
    """The MCP_TEST_LABEL environment variable of the server."""
    return os.environ.get("MCP_TEST_LABEL", "unset")


@server.tool()
def crash() -> str:
    """Exit the server process at once."""
    os._exit(3)


if __name__ == "__main__":
    server.run()
