"""MCP tools against real MCP servers (tests/tools/mcp_test_server.py, written with the SDK): a stdio process
and the same server over streamable HTTP (uvicorn on loopback), loaded through the tool YAML registry."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
import uvicorn
import yaml
from model_helpers import call_text, sample, scripted_engine

from verl_agent.cli import main
from verl_agent.engine.contract import SamplingParams
from verl_agent.protocol import ToolCall
from verl_agent.reward import load_reward_fn
from verl_agent.rollout.agent_loop import AgentLoop
from verl_agent.rollout.metrics import summarize
from verl_agent.tools import ToolConfigError, ToolSession, load_tools
from verl_agent.tools.mcp import MCPSearchTool, MCPTool

SERVER = Path(__file__).with_name("mcp_test_server.py")
NAMES = {"add", "distance", "code", "refuse", "slow", "pid", "label", "crash"}


def write_config(folder: Path, servers: dict, class_name: str = "verl.tools.mcp_base_tool.MCPBaseTool",
                 config: dict | None = None, **mcp: object) -> Path:
    (folder / "servers.json").write_text(json.dumps({"mcpServers": servers}))
    entry = {"class_name": class_name, "config": {"type": "mcp", **(config or {})},
             "mcp": {"mcp_servers_config_path": "servers.json", **mcp}}
    path = folder / "tools.yaml"
    path.write_text(yaml.safe_dump({"tools": [entry]}))
    return path


def stdio_server(label: str = "stdio") -> dict:
    return {"command": sys.executable, "args": [str(SERVER)], "env": {"MCP_TEST_LABEL": label}}


@pytest.fixture(scope="module")
def worker_tools(tmp_path_factory):
    """verl's MCPSearchTool entry over one stdio server process, shared by this module's tests."""
    folder = tmp_path_factory.mktemp("mcp_worker")
    tools = load_tools(write_config(folder, {"demo": stdio_server()}, "verl.tools.mcp_search_tool.MCPSearchTool",
                                    {"timeout": 1.0, "rate_limit": 100}))
    yield tools
    asyncio.run(tools["add"].shutdown())


async def call(session: ToolSession, name: str, **args: object):
    return await session.call(ToolCall(name, args))


async def test_stdio_tools_are_listed_with_their_schemas_and_called(worker_tools):
    assert set(worker_tools) == NAMES and all(isinstance(t, MCPSearchTool) for t in worker_tools.values())
    params = worker_tools["distance"].get_openai_tool_schema().to_openai()["function"]["parameters"]
    assert params["properties"]["p"] == {"$ref": "#/$defs/Point"} and params["required"] == ["p"]
    assert params["$defs"]["Point"]["required"] == ["x", "y"]  # the server's schema, as sent
    async with ToolSession(worker_tools, timeout=10) as s:
        assert (await call(s, "add", a=2, b=3)).text == "5"
        assert (await call(s, "label")).text == "stdio"  # the servers file's env reached the process
        assert (await call(s, "distance", p={"x": 3, "y": -4}, norm="max")).text == "4"
        nested = await call(s, "distance", p={"x": 3})  # $ref/$defs checked before the server sees it
        assert (nested.ok, nested.infra, nested.text) == (False, None, 'Error: missing required argument "p.y"')
        pattern = await call(s, "code", value="abc")
        assert not pattern.ok and pattern.text == "Error: argument \"value\": 'abc' does not match the pattern " \
                                                  "'^[A-Z]{3}$'"
        refused = await call(s, "refuse", record="r1")  # isError: the model reads it, no infra failure
        assert (refused.ok, refused.infra, refused.metrics["mcp_is_error"]) == (True, None, True)
        assert refused.text == "Error executing tool refuse: no such record: r1"  # the SDK's words
    assert worker_tools["add"].server.connections() == 1


async def test_timeout_hang_and_crash_are_infra_failures_and_the_server_restarts(worker_tools):
    server = worker_tools["pid"].server
    async with ToolSession(worker_tools, timeout=20) as s:
        first = int((await call(s, "pid")).text)
        slow = await call(s, "slow", seconds=3)  # the server still answers pings: only the call timed out
        assert (slow.ok, slow.infra) == (False, "mcp_timeout") and "timed out after 1 s" in slow.text
        assert int((await call(s, "pid")).text) == first and server.restarts == 0
        os.kill(first, signal.SIGSTOP)  # hung: neither the call nor a ping is answered
        hung = await call(s, "label")  # not annotated read-only or idempotent: not called twice
        assert (hung.ok, hung.infra) == (False, "mcp_server_hung") and server.restarts == 1
        second = int((await call(s, "pid")).text)
        crashed = await call(s, "crash")
        assert (crashed.ok, crashed.infra) == (False, "mcp_server_crashed") and server.restarts == 2
        third = int((await call(s, "pid")).text)
    assert len({first, second, third}) == 3
    deadline = time.monotonic() + 15
    while _alive(first) and time.monotonic() < deadline:  # the hung process is killed, not leaked
        await asyncio.sleep(0.1)
    assert not _alive(first)


async def test_a_hung_server_fails_its_calls_in_flight_at_once_and_idempotent_ones_run_again(worker_tools):
    """A server that hangs with 8 calls in flight: the hang is found within the call timeout (1 s), the server
    is replaced once, the 6 calls of the read-only `add` run on the new one, the 2 of `label` (no annotation)
    fail as infrastructure."""
    server = worker_tools["add"].server
    restarts, retries = server.restarts, server.retries
    async with ToolSession(worker_tools, timeout=20) as s:
        old = int((await call(s, "pid")).text)
        os.kill(old, signal.SIGSTOP)
        t0 = time.monotonic()
        results = await asyncio.gather(*(call(s, "add", a=i, b=1) for i in range(6)), call(s, "label"),
                                       call(s, "label"))
        elapsed = time.monotonic() - t0
        assert [r.text for r in results[:6]] == [str(i + 1) for i in range(6)] and all(r.ok for r in results[:6])
        assert [(r.ok, r.infra) for r in results[6:]] == [(False, "mcp_server_hung")] * 2
        assert (server.restarts - restarts, server.retries - retries) == (1, 6)
        assert results[6].seconds < 1.0 + 0.5  # found by the probe within the call timeout, not after it
        assert int((await call(s, "pid")).text) != old and elapsed < 15


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


async def _pids_of_two_trajectories(tools: dict) -> list[int]:
    async def one() -> int:
        async with ToolSession(tools, timeout=10) as s:
            return int((await call(s, "pid")).text)

    return list(await asyncio.gather(one(), one()))


async def test_one_process_per_worker_or_per_trajectory(worker_tools, tmp_path):
    a, b = await _pids_of_two_trajectories(worker_tools)
    assert a == b
    tools = load_tools(write_config(tmp_path, {"demo": stdio_server()}, server_scope="trajectory",
                                    tool_selected_list=["pid"]))
    server = tools["pid"].server
    assert set(tools) == {"pid"} and isinstance(tools["pid"], MCPTool) and server.connections() == 0
    c, d = await _pids_of_two_trajectories(tools)
    assert len({a, c, d}) == 3 and server.starts == 3  # the listing's own process, then one per trajectory
    assert server.connections() == 0  # closed at release


def serve_http(port: int = 0, token: str | None = None) -> tuple[uvicorn.Server, threading.Thread, int]:
    """The test server over streamable HTTP on loopback (behind a bearer token, if given), on a thread."""
    from mcp_test_server import server

    app = server.streamable_http_app()

    async def guarded(scope, receive, send):
        auth = dict(scope.get("headers") or []).get(b"authorization")
        if token and scope["type"] == "http" and auth != f"Bearer {token}".encode():
            await send({"type": "http.response.start", "status": 401, "headers": []})
            await send({"type": "http.response.body", "body": b"unauthorized"})
            return
        await app(scope, receive, send)

    if not port:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(guarded, host="127.0.0.1", port=port, log_level="warning",
                                       timeout_graceful_shutdown=0.5))  # a client's open event stream ends too
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    while not uv.started:
        time.sleep(0.02)
    return uv, thread, port


def stop_http(uv: uvicorn.Server, thread: threading.Thread) -> None:
    uv.should_exit = True
    thread.join(10)


@pytest.fixture(scope="module")
def http_url():
    uv, thread, port = serve_http(token="s3cret")
    yield f"http://127.0.0.1:{port}/mcp"
    stop_http(uv, thread)


async def test_http_server_with_a_token_and_verls_rate_limit(http_url, tmp_path):
    tools = load_tools(write_config(tmp_path, {"web": {"url": http_url, "auth_token": "s3cret"}},
                                    config={"rate_limit": 4}, tool_selected_list=["add", "pid"]))
    assert set(tools) == {"add", "pid"}
    async with ToolSession(tools, timeout=10) as s:
        assert int((await call(s, "pid")).text) == os.getpid()  # served by this process's uvicorn
        start = time.monotonic()  # at most 4 tokens (one second's calls) in the bucket, then 4 per second
        results = await asyncio.gather(*(call(s, "add", a=i, b=1) for i in range(11)))
        elapsed = time.monotonic() - start
    assert [r.text for r in results] == [str(i + 1) for i in range(11)]
    assert 1.7 <= elapsed < 6.0, elapsed  # at least (11 - 4) calls / 4 per second
    await tools["add"].shutdown()
    bad = write_config(tmp_path, {"web": {"url": http_url, "auth_token": "wrong"}})
    with pytest.raises(ToolConfigError, match=r"MCP server 'web' .* cannot list its tools: .*"):
        load_tools(bad)


async def test_an_http_server_that_went_away_is_restarted(tmp_path):
    uv, thread, port = serve_http()
    tools = load_tools(write_config(tmp_path, {"web": {"url": f"http://127.0.0.1:{port}/mcp", "type": "http"}},
                                    tool_selected_list=["add", "pid"]))
    async with ToolSession(tools, timeout=10) as s:
        assert (await call(s, "add", a=1, b=1)).text == "2"
        stop_http(uv, thread)
        gone = await call(s, "pid")  # not annotated idempotent (`add` is: it would be called again)
        down = await call(s, "pid")  # the restart finds nothing to connect to
        uv, thread, _ = serve_http(port)
        back = await call(s, "add", a=1, b=2)
    stop_http(uv, thread)
    assert (gone.infra, down.infra, back.text) == ("mcp_server_crashed", "mcp_server_unavailable", "3")
    assert (tools["add"].server.restarts, tools["add"].server.starts) == (1, 2)
    await tools["add"].shutdown()


@pytest.mark.parametrize("servers, mcp, fragment", [
    ({"s": {"url": "http://x", "command": "y"}}, {}, "server 's': give either 'url'"),
    ({"s": {"command": "y", "auth_token": "t"}}, {}, "'headers' and 'auth_token' need a 'url' server"),
    ({"s": {"command": "y", "trasport": "stdio"}}, {}, "server 's': trasport: Extra inputs are not permitted"),
    ({"s": {"command": "y"}}, {"server_scope": "step"}, "mcp.server_scope must be 'worker' or 'trajectory'"),
    ({"s": {"command": "y"}}, {"tool_list": ["a"]}, r"unknown mcp key\(s\) \['tool_list'\]"),
    ({"s": {"command": "y", "disabled": True}}, {}, "every server is disabled"),
    ({"s": {"command": "/nonexistent/mcp-server"}}, {}, "MCP server 's' .*cannot list its tools: .*cannot be started"),
])
def test_config_errors_name_the_file_entry_and_server(tmp_path, servers, mcp, fragment):
    path = write_config(tmp_path, servers, **mcp)
    with pytest.raises(ToolConfigError, match=rf"tools.yaml: tools\[0\] \(verl.tools.mcp_base_tool.MCPBaseTool\): "
                                              rf".*{fragment}"):
        load_tools(path)


def test_tools_list_prints_mcp_and_python_tools(http_url, tmp_path, capsys):
    path = write_config(tmp_path, {"web": {"url": http_url, "headers": {"Authorization": "Bearer s3cret"}}},
                        tool_selected_list=["distance"])
    entries = yaml.safe_load(path.read_text())["tools"] + [{"class_name": "verl_agent.tools.calculator.CalculatorTool"}]
    path.write_text(yaml.safe_dump({"tools": entries}))
    assert main(["tools", "list", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"distance  [MCP server 'web' ({http_url})]" and out[1] == "  Distance of a point from the origin."
    assert json.loads(out[2].removeprefix("  parameters: "))["$defs"]["Point"]["type"] == "object"
    assert out[3] == "calculator  [verl_agent.tools.calculator.CalculatorTool]"
    assert main(["tools", "list", "examples/calculator/config.yaml", "--json"]) == 0  # a run config's tools
    assert [t["function"]["name"] for t in json.loads(capsys.readouterr().out)] == ["calculator"]
    missing = write_config(tmp_path, {"web": {"url": http_url, "auth_token": "s3cret"}},
                           tool_selected_list=["add", "tavily_search_tool"])
    assert main(["tools", "list", str(missing)]) == 2
    assert "tool_selected_list names ['tavily_search_tool'], which no server" in capsys.readouterr().err


async def test_agent_loop_calls_an_mcp_tool_and_a_crash_ends_only_its_trajectory(worker_tools, chat_tokenizer,
                                                                                  rollout_cfg):
    tok, sp = chat_tokenizer, SamplingParams(max_new_tokens=200)

    def reply(text: str, k: int) -> str:
        if k == 0:
            return call_text("crash", "{}") if "Crash" in text else call_text("add", '{"a": 12, "b": 30}')
        return "The answer is 42."

    tools = {name: worker_tools[name] for name in ("add", "crash")}
    def reward(data_source, solution_str, ground_truth, extra_info=None):
        return float(ground_truth in solution_str)

    loop = AgentLoop(scripted_engine(tok, reply), tok, rollout_cfg, tools=tools, max_prompt_length=2000,
                     max_response_length=400, reward_fn=load_reward_fn(reward))
    good = (await loop.run([sample("What is 12 + 30?", uid="ok", ground_truth="42")], 1, sp)).trajectories[0]
    assert (good.outcome, good.reward, good.metrics["num_tool_calls"]) == ("ok", 1.0, 1)
    assert [m.content for m in good.messages if m.role == "tool"] == ["42"]
    crashed = (await loop.run([sample("Crash it.", uid="bad", ground_truth="42")], 1, sp)).trajectories[0]
    assert (crashed.outcome, crashed.cause) == ("infra_failure", "mcp_server_crashed")
    assert summarize([good, crashed])["rollout/infra_failed/mcp_server_crashed"] == 1.0
    again = (await loop.run([sample("What is 12 + 30?", uid="ok2", ground_truth="42")], 1, sp)).trajectories[0]
    assert again.outcome == "ok"  # the server was restarted


async def test_a_call_retried_after_a_hang_is_counted_in_the_rollout_metrics(worker_tools, chat_tokenizer,
                                                                             rollout_cfg):
    """The server hangs before the trajectory's read-only `add` call: the call runs again on a fresh server, the
    trajectory is scored, and the retry shows as mcp/retried (rollout/mcp/retried over a batch)."""
    tok, sp = chat_tokenizer, SamplingParams(max_new_tokens=200)

    def reply(text: str, k: int) -> str:
        return call_text("add", '{"a": 12, "b": 30}') if k == 0 else "The answer is 42."

    def reward(data_source, solution_str, ground_truth, extra_info=None):
        return float(ground_truth in solution_str)

    async with ToolSession(worker_tools, timeout=10) as s:
        os.kill(int((await call(s, "pid")).text), signal.SIGSTOP)
    loop = AgentLoop(scripted_engine(tok, reply), tok, rollout_cfg, tools={"add": worker_tools["add"]},
                     max_prompt_length=2000, max_response_length=400, reward_fn=load_reward_fn(reward))
    hung = (await loop.run([sample("What is 12 + 30?", uid="r", ground_truth="42")], 1, sp)).trajectories
    again = (await loop.run([sample("What is 12 + 30?", uid="q", ground_truth="42")], 1, sp)).trajectories
    assert [(t.outcome, t.reward) for t in hung + again] == [("ok", 1.0)] * 2
    assert [m.content for t in hung + again for m in t.messages if m.role == "tool"] == ["42", "42"]
    assert [t.metrics["mcp/retried"] for t in hung + again] == [1.0, 0.0]
    metrics = summarize(hung + again)
    assert metrics["rollout/mcp/retried"] == 1.0 and metrics["rollout/num_scored"] == 2.0
    assert "rollout/infra_failed/mcp_server_hung" not in metrics
