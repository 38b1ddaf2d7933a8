"""The calculator as an MCP server (stdio), for bench/mcp_hung.py and the `tools list` reproduction of issue 44.

Tools: `calculator` (the built-in tool's arithmetic, annotated read-only unless MCP_BENCH_ANNOTATE=0), and two
search-style tools with the long descriptions such servers carry, `web_search` and `fetch_page` (they answer
with canned text: only their schemas matter here).

Fault injection for bench/mcp_hung.py (environment):

* MCP_BENCH_HANG_AT=N: the process that gets its N-th `calculator` call first SIGSTOPs itself before answering
  it (a hang mid-step: the calls in flight and every later one get no answer, nor does a tools/list);
* MCP_BENCH_MARKER=PATH: created (O_EXCL) by the process that hangs, so that only one server ever hangs, not the
  other rollout worker's nor the fresh server that replaces it.
"""

from __future__ import annotations

import os
import signal
from typing import Annotated

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import ToolAnnotations
from pydantic import Field

from verl_agent.tools.calculator import CalculatorError, evaluate, format_number

server = MCPServer("calculator", log_level="WARNING")
_calls = 0
_READ_ONLY = os.environ.get("MCP_BENCH_ANNOTATE", "1") != "0"


def _maybe_hang() -> None:
    global _calls
    _calls += 1
    hang_at, marker = int(os.environ.get("MCP_BENCH_HANG_AT", "0")), os.environ.get("MCP_BENCH_MARKER")
    if not hang_at or _calls != hang_at or not marker:
        return
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:  # another server hung already
        return
    with open(marker, "w") as f:
        f.write(f"{os.getpid()}\n")
    os.kill(os.getpid(), signal.SIGSTOP)


@server.tool(annotations=ToolAnnotations(read_only_hint=True) if _READ_ONLY else None)
def calculator(expression: Annotated[str, Field(description="The arithmetic expression, e.g. 37 * 12 + 5")]) -> str:
    """Evaluate an arithmetic expression and return the result."""
    _maybe_hang()
    try:
        return format_number(evaluate(expression))
    except CalculatorError as e:
        raise ToolError(str(e)) from None


# The schema the calculator example's tools.yaml gives the built-in tool, word for word (not the SDK's, which adds
# titles): the tiny model was trained on that prompt, and calls the tool about half the time with it.
server._tool_manager.get_tool("calculator").parameters = {
    "type": "object", "required": ["expression"],
    "properties": {"expression": {"type": "string", "description": "The arithmetic expression, e.g. 37 * 12 + 5"}}}


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
def web_search(
    query: Annotated[str, Field(description="The search query. Use natural language or keywords; quote exact "
                                "phrases; use site:example.com to restrict to one site and -word to exclude a word.")],
    max_results: Annotated[int, Field(ge=1, le=20, description="How many results to return (1-20).")] = 5,
    recency_days: Annotated[int | None, Field(ge=1, description="Only pages published within this many days; "
                                              "omit for any date.")] = None,
    region: Annotated[str, Field(pattern=r"^[a-z]{2}-[a-z]{2}$", description="Region and language of the results, "
                                 "e.g. us-en, de-de, fr-fr.")] = "us-en",
) -> str:
    """Search the web and return the top results, each with its title, URL, publication date and a short
    snippet of the page. Use it for facts that may have changed recently, for anything you are not sure of,
    and to find pages to read in full with fetch_page. Results are ranked by relevance; prefer primary sources."""
    return f"no results for {query!r} (this bench server has no index)"


@server.tool(annotations=ToolAnnotations(read_only_hint=True))
def fetch_page(
    url: Annotated[str, Field(description="The absolute http(s) URL of the page to fetch.")],
    max_chars: Annotated[int, Field(ge=100, le=100000, description="Cut the page's text after this many "
                                    "characters.")] = 8000,
    start_char: Annotated[int, Field(ge=0, description="Start at this character of the page's text, to read a "
                                     "long page in parts.")] = 0,
    as_markdown: Annotated[bool, Field(description="Return the main content as Markdown (headings, lists, "
                                       "links) instead of plain text.")] = True,
) -> str:
    """Fetch a web page and return its main content as text or Markdown, without navigation, ads and scripts.
    Use it after web_search to read a result in full. Long pages are cut at max_chars; read on with start_char."""
    return f"cannot fetch {url} (this bench server is offline)"


if __name__ == "__main__":
    server.run()
