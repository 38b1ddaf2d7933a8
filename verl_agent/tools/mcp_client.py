"""MCP servers for tools: the servers file, one live connection per server (or per trajectory), restarts.

The servers file is the usual ``{"mcpServers": {name: {...}}}``; a server has either

* ``url`` (streamable HTTP), optional ``headers`` and ``auth_token`` (sent as ``Authorization: Bearer``), or
* ``command`` with optional ``args``, ``env`` and ``cwd`` (a process spoken to over stdio),

and may say ``type`` (``stdio`` / ``http`` / ``streamable-http``, checked against the keys) and ``disabled``.

Every connection lives on one event loop on a thread of its own (one per process), so the tools work from
any caller's loop and the MCP SDK's tasks never outlive the loop that made them. A call that finds its
server gone (the process exited, the HTTP connection broke: cause ``mcp_server_crashed``) or hung raises
`ToolUnavailable` and drops the connection; the next call starts the server again (`MCPServer.restarts`
counts it). A hang is found within the call timeout: a call without an answer after `probe_interval`
(half the timeout, at most 5 s) asks the server for a fresh tools/list (one probe at a time per connection,
shared by the calls in flight); no answer within another `probe_interval` marks the connection dead, and
every call in flight on it gives up at once (``mcp_server_hung``), instead of each waiting out its timeout.
A call to a tool the server annotates read-only or idempotent (``readOnlyHint`` / ``idempotentHint``) that a
hang or a crash cut off runs once more on the fresh server (`MCPServer.retries` counts it); the others
fail as infrastructure, since running them twice could do their effect twice. A call that timed out on a
server that still answers is ``mcp_timeout``; a server that cannot be started or reached is
``mcp_server_unavailable``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from verl_agent.tools.errors import ToolArgumentError, ToolConfigError, ToolUnavailable
from verl_agent.yaml_registry import read_config_file

__all__ = ["START_TIMEOUT", "MCPServer", "MCPServerSpec", "RateLimiter", "load_servers", "on_mcp_loop",
           "run_on_mcp_loop"]

logger = logging.getLogger(__name__)

_PAGES = 100  # tools/list pages read at most (a paginator that never ends cannot hang the start)
START_TIMEOUT = 60.0  # seconds for a server to start and answer the handshake (a process may import a lot)


class MCPServerSpec(BaseModel):
    """One server of the servers file."""

    model_config = ConfigDict(extra="forbid")

    url: str | None = None
    headers: dict[str, str] = {}
    auth_token: str | None = None
    command: str | None = None
    args: list[str] = []
    env: dict[str, str] = {}
    cwd: str | None = None
    type: Literal["stdio", "http", "streamable-http", "streamable_http", "streamableHttp"] | None = None
    disabled: bool = False

    @model_validator(mode="after")
    def _one_transport(self) -> MCPServerSpec:
        if (self.url is None) == (self.command is None):
            raise ValueError("give either 'url' (streamable HTTP) or 'command' (stdio), not both or neither")
        if self.url is None and (self.headers or self.auth_token):
            raise ValueError("'headers' and 'auth_token' need a 'url' server")
        if self.command is None and (self.args or self.env or self.cwd):
            raise ValueError("'args', 'env' and 'cwd' need a 'command' server")
        if self.type is not None and (self.type == "stdio") != (self.command is not None):
            raise ValueError(f"'type: {self.type}' does not match the server's {'command' if self.command else 'url'}")
        return self

    def transport(self) -> Any:
        """What `mcp.Client` connects to."""
        from mcp import StdioServerParameters

        if self.command is not None:
            return StdioServerParameters(command=self.command, args=self.args, env=self.env or None, cwd=self.cwd)
        for name in ("httpx", "httpx2"):  # HTTP clients log every request at INFO: one line per tool call
            if logging.getLogger(name).level == logging.NOTSET:
                logging.getLogger(name).setLevel(logging.WARNING)
        headers = dict(self.headers)
        if self.auth_token:
            headers["Authorization"] = f"Bearer {self.auth_token}"
        return _http_transport(self.url or "", headers)


@asynccontextmanager
async def _http_transport(url: str, headers: dict[str, str]) -> AsyncIterator[Any]:
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared._httpx_utils import create_mcp_http_client

    async with create_mcp_http_client(headers=headers or None) as http:
        async with streamable_http_client(url, http_client=http) as streams:
            yield streams


def load_servers(path: str | Path) -> dict[str, MCPServerSpec]:
    """The enabled servers of a servers file; errors name the file and the server."""
    path = Path(path)
    data = read_config_file(path, ToolConfigError, json.loads, "JSON", what="MCP servers file ")
    servers = data.get("mcpServers") if isinstance(data, dict) else None
    if not isinstance(servers, dict) or not servers:
        raise ToolConfigError(f'MCP servers file {path}: expected {{"mcpServers": {{name: {{...}}}}}} with a server')
    out: dict[str, MCPServerSpec] = {}
    for name, raw in servers.items():
        try:
            spec = MCPServerSpec.model_validate(raw)
        except ValidationError as e:
            raise ToolConfigError(f"MCP servers file {path}: server {name!r}: {_first_error(e)}") from None
        if not spec.disabled:
            out[name] = spec
    return out


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    where = ".".join(str(p) for p in err["loc"])
    return f"{where}: {err['msg']}" if where else err["msg"].removeprefix("Value error, ")


_LOOP: asyncio.AbstractEventLoop | None = None
_LOOP_LOCK = threading.Lock()


def _mcp_loop() -> asyncio.AbstractEventLoop:
    """The event loop every MCP connection of this process lives on (a daemon thread, started once)."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None:
            _LOOP = asyncio.new_event_loop()
            threading.Thread(target=_LOOP.run_forever, name="mcp-loop", daemon=True).start()
        return _LOOP


async def on_mcp_loop(coro: Coroutine[Any, Any, Any]) -> Any:
    """Await `coro` on the MCP loop from any other loop (cancelling the caller cancels it there)."""
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, _mcp_loop()))


def run_on_mcp_loop(coro: Coroutine[Any, Any, Any], timeout: float) -> Any:
    """Run `coro` on the MCP loop from synchronous code (tool loading) and wait at most `timeout` s."""
    future = asyncio.run_coroutine_threadsafe(coro, _mcp_loop())
    try:
        return future.result(timeout)
    except TimeoutError:
        future.cancel()
        raise


class RateLimiter:
    """verl's MCP `rate_limit`: calls per second, a token bucket that holds at most one second's calls."""

    def __init__(self, per_second: float) -> None:
        if per_second <= 0:
            raise ToolConfigError(f"config.rate_limit must be > 0 calls per second, got {per_second}")
        self.rate = float(per_second)
        self.tokens, self.stamp = self.rate, time.monotonic()

    async def acquire(self) -> None:
        while True:
            now = time.monotonic()
            self.tokens, self.stamp = min(self.rate, self.tokens + (now - self.stamp) * self.rate), now
            if self.tokens >= 1:
                self.tokens -= 1
                return
            await asyncio.sleep((1 - self.tokens) / self.rate)


def _leaf(e: BaseException) -> BaseException:
    """The first real error inside the exception groups of anyio's task groups."""
    while isinstance(getattr(e, "exceptions", None), tuple) and e.exceptions:  # type: ignore[attr-defined]
        e = e.exceptions[0]  # type: ignore[attr-defined]
    return e


class _Connection:
    """One `mcp.Client`, entered and left by one owner task (the SDK's task groups require it)."""

    def __init__(self, spec: MCPServerSpec) -> None:
        self.spec = spec
        self.client: Any = None
        self.dead = asyncio.Event()  # a probe found the server hung: every call in flight on it gives up
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._probe: asyncio.Future | None = None

    async def open(self, timeout: float) -> _Connection:
        ready: asyncio.Future = asyncio.get_running_loop().create_future()
        self._task = asyncio.create_task(self._own(ready))
        try:
            await asyncio.wait_for(asyncio.shield(ready), timeout)
        except BaseException:
            await self.close()
            raise
        return self

    async def _own(self, ready: asyncio.Future) -> None:
        from mcp import Client

        try:
            async with Client(self.spec.transport(), mode="legacy") as client:
                self.client = client
                ready.set_result(None)
                await self._stop.wait()
        except BaseException as e:  # a start that failed, or a transport that broke while closing
            if not ready.done():
                ready.set_exception(e if isinstance(e, Exception) else RuntimeError(repr(e)))
            if isinstance(e, asyncio.CancelledError):
                raise

    async def answers(self, within: float) -> bool:
        """Does the server answer a fresh tools/list (the request every protocol version has) within `within`
        s? One probe at a time: the calls in flight on this connection share it."""
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(self._ask(within))
        return await asyncio.shield(self._probe)

    async def _ask(self, within: float) -> bool:
        try:
            await asyncio.wait_for(self.client.list_tools(cache_mode="refresh"), within)
        except Exception:
            return False
        return True

    async def close(self) -> None:
        self._stop.set()
        if self._task is not None and not self._task.done():
            try:
                await asyncio.wait_for(asyncio.shield(self._task), 10)
            except (Exception, asyncio.CancelledError):
                self._task.cancel()


class _Watch:
    """Runs a call in the calling task while a side task probes its server every `interval` s: once the server
    does not answer a probe (or another call's probe found it hung), the call is cancelled and raises
    ToolUnavailable (mcp_server_hung)."""

    def __init__(self, conn: _Connection, interval: float) -> None:
        self.conn, self.interval, self.hung = conn, interval, False

    async def run(self, coro: Coroutine[Any, Any, Any], timeout: float) -> Any:
        caller = asyncio.current_task()
        assert caller is not None
        watcher = asyncio.ensure_future(self._watch(caller))
        try:
            return await asyncio.wait_for(coro, timeout)
        except asyncio.CancelledError:
            if not self.hung:
                raise
            if hasattr(caller, "uncancel"):  # Python 3.11+: the cancel was ours, not the caller's
                caller.uncancel()
            raise ToolUnavailable("hung: no answer to a call nor to a tools/list probe (it will be restarted)",
                                  cause="mcp_server_hung") from None
        finally:
            watcher.cancel()

    async def _watch(self, caller: asyncio.Task) -> None:
        while True:
            try:
                await asyncio.wait_for(self.conn.dead.wait(), self.interval)
            except asyncio.TimeoutError:
                if await self.conn.answers(self.interval):
                    continue
            self.conn.dead.set()
            self.hung = True
            caller.cancel()
            return


class MCPServer:
    """A server as the tools of one YAML entry see it: its connections (one for the worker, or one per
    trajectory when `per_trajectory`), calls with a timeout and the rate limit, restarts. Every coroutine
    here runs on the MCP loop (the tools go through `on_mcp_loop`)."""

    def __init__(self, name: str, spec: MCPServerSpec, timeout: float, limiter: RateLimiter,
                 per_trajectory: bool = False) -> None:
        self.name, self.spec, self.timeout, self.limiter = name, spec, timeout, limiter
        self.per_trajectory = per_trajectory
        self.starts = 0  # connections opened (server processes started, for stdio)
        self.restarts = 0  # connections dropped after a crash or a hang (the next call starts a new one)
        self.retries = 0  # calls of read-only / idempotent tools run again after a crash or a hang
        self.probe_interval = min(5.0, timeout / 2)  # probe after this long without an answer; probe's own limit
        self._conns: dict[str | None, _Connection] = {}  # key: the trajectory id, or None for the worker's
        self._users: dict[str, int] = {}  # tools of a trajectory that hold its connection
        self._starting: dict[str | None, asyncio.Lock] = {}  # one start at a time per key, keys in parallel
        self._closing: set[asyncio.Task] = set()

    async def list_tools(self) -> list[Any]:
        """Every tool the server offers (all pages); the worker connection stays open unless per trajectory."""
        conn = await self._connection(None)
        try:
            tools, cursor = [], None
            for _ in range(_PAGES):
                page = await asyncio.wait_for(conn.client.list_tools(cursor=cursor), max(self.timeout, 30.0))
                tools.extend(page.tools)
                cursor = page.next_cursor
                if cursor is None:
                    break
            return tools
        finally:
            if self.per_trajectory:
                await self._drop(None)

    def _key(self, trajectory: str) -> str | None:
        return trajectory if self.per_trajectory else None

    async def _connection(self, key: str | None) -> _Connection:
        async with self._starting.setdefault(key, asyncio.Lock()):
            conn = self._conns.get(key)
            if conn is None:
                try:
                    conn = await _Connection(self.spec).open(max(START_TIMEOUT, self.timeout))
                except Exception as e:
                    e = _leaf(e)
                    raise ToolUnavailable(f"MCP server {self.name!r} cannot be started or reached: "
                                          f"{type(e).__name__}: {e}", cause="mcp_server_unavailable") from e
                self.starts += 1
                self._conns[key] = conn
            return conn

    async def _drop(self, key: str | None, conn: _Connection | None = None) -> None:
        """Close the connection under `key`; with `conn` (a failure): only if it is still that one, and
        counted as a restart."""
        current = self._conns.get(key)
        if current is None or (conn is not None and current is not conn):
            return
        del self._conns[key]
        if conn is None:
            await current.close()
            return
        self.restarts += 1
        closing = asyncio.create_task(current.close())  # a hung process takes seconds to kill: not on the call
        self._closing.add(closing)
        closing.add_done_callback(self._closing.discard)

    async def open(self, trajectory: str) -> None:
        """A trajectory starts using the server (its own connection opens on its first call)."""
        self._users[trajectory] = self._users.get(trajectory, 0) + 1

    async def release(self, trajectory: str) -> None:
        """A trajectory's tool is done; its connection closes with the last of them."""
        left = self._users.get(trajectory, 1) - 1
        if left > 0:
            self._users[trajectory] = left
            return
        self._users.pop(trajectory, None)
        if self.per_trajectory:
            await self._drop(trajectory)
            self._starting.pop(trajectory, None)

    async def call(self, trajectory: str, tool: str, arguments: dict[str, Any], retry: bool = False
                   ) -> tuple[Any, bool]:
        """`tools/call` under the rate limit and the timeout: (the SDK's CallToolResult, whether it was called
        again). `retry`: the tool is read-only or idempotent, so a call that a crash or a hang cut off runs once
        more on the fresh server (a second failure is final)."""
        try:
            return await self._call_once(self._key(trajectory), tool, arguments), False
        except ToolUnavailable as e:
            if not retry or e.cause not in ("mcp_server_hung", "mcp_server_crashed"):
                raise
            self.retries += 1
            logger.warning("MCP server %r: %s; calling %r again on the fresh server (the tool is annotated "
                           "read-only or idempotent)", self.name, e, tool)
        return await self._call_once(self._key(trajectory), tool, arguments), True

    async def _call_once(self, key: str | None, tool: str, arguments: dict[str, Any]) -> Any:
        from mcp import MCPError
        from mcp_types import CONNECTION_CLOSED, INVALID_PARAMS, REQUEST_TIMEOUT

        conn = await self._connection(key)
        await self.limiter.acquire()
        watch = _Watch(conn, self.probe_interval)
        try:
            # awaited in this task, not a task of its own: the SDK's HTTP transport stalls a request sent from one
            return await watch.run(conn.client.call_tool(tool, arguments, read_timeout_seconds=self.timeout),
                                   self.timeout + 1)
        except asyncio.TimeoutError:
            return await self._timed_out(key, conn, tool)
        except ToolUnavailable as e:
            raise ToolUnavailable(f"MCP server {self.name!r}: {e}", cause=e.cause) from None
        except MCPError as e:
            if e.code == REQUEST_TIMEOUT:
                return await self._timed_out(key, conn, tool)
            if e.code == INVALID_PARAMS:  # the server refused the arguments: the model's to fix
                raise ToolArgumentError(f'{tool}: {e.message}') from None
            if e.code != CONNECTION_CLOSED:
                raise ToolUnavailable(f"MCP server {self.name!r}: error {e.code}: {e.message}",
                                      cause="mcp_error") from e
            await self._drop(key, conn)
            raise ToolUnavailable(f"MCP server {self.name!r} closed the connection (it will be restarted)",
                                  cause="mcp_server_crashed") from e
        except Exception as e:  # the transport broke: a dead process, a refused HTTP connection
            await self._drop(key, conn)
            e = _leaf(e)
            raise ToolUnavailable(f"MCP server {self.name!r} failed: {type(e).__name__}: {e} (it will be "
                                  f"restarted)", cause="mcp_server_crashed") from e
        finally:
            if watch.hung:
                await self._drop(key, conn)

    async def _timed_out(self, key: str | None, conn: _Connection, tool: str) -> Any:
        """A slow call on a live server, or a hung server (no answer to a fresh tools/list, the request every
        protocol version has): then it is restarted."""
        if not await conn.answers(self.probe_interval):
            conn.dead.set()
            await self._drop(key, conn)
            raise ToolUnavailable(f"MCP server {self.name!r} hung: {tool!r} got no answer in {self.timeout:g} s "
                                  "and a tools/list none either (it will be restarted)",
                                  cause="mcp_server_hung") from None
        raise ToolUnavailable(f"MCP tool {tool!r} timed out after {self.timeout:g} s", cause="mcp_timeout")

    def connections(self) -> int:
        """Connections open now (one per worker, or one per trajectory that called the server)."""
        return len(self._conns)

    async def shutdown(self) -> None:
        """Close every connection (stdio servers exit); the server starts again if used later."""
        for key in list(self._conns):
            await self._drop(key)
        await asyncio.gather(*self._closing, return_exceptions=True)
