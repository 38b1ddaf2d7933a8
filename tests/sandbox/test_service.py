"""Server robustness (overload, crashed workers), the async client, the code tool and the code reward."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import uuid
from pathlib import Path

import httpx
import pytest
from sandbox_helpers import agent_of, host_pid

from verl_agent.sandbox.backends.process import ProcessBackend
from verl_agent.sandbox.client import ClientLimits, SandboxClient, SandboxUnavailable
from verl_agent.sandbox.code_reward import score_code
from verl_agent.sandbox.service import ServiceSettings
from verl_agent.tools.sandbox_fusion import SandboxFusionTool


@pytest.fixture(scope="module")
def tiny_server(server_thread_cls):
    """One worker, one waiting slot: easy to overload."""
    settings = ServiceSettings(min_pool_size=1, max_pool_size=1, max_queue=1, queue_timeout=20.0, default_memory_mb=256)
    with server_thread_cls(ProcessBackend(memory_mb=256, tmpfs_mb=16), settings) as server:
        yield server


async def test_overload_answers_503_fast_and_client_retries(tiny_server):
    async with httpx.AsyncClient(base_url=tiny_server.url, timeout=30) as http:
        body = {"code": "sleep 2", "language": "bash"}
        slow = [asyncio.create_task(http.post("/run_code", json=body)) for _ in range(2)]
        deadline = time.monotonic() + 10
        service = tiny_server.service
        while not (service.pool.waiting() == 1 and service.pool.idle() == 0) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # one runs, one waits
        t0 = time.monotonic()
        refused = await http.post("/run_code", json=body)
        assert refused.status_code == 503 and refused.headers["Retry-After"] == "1"
        assert time.monotonic() - t0 < 1.0 and "overloaded" in refused.json()["message"]
        # a retry (marked by SandboxClient) takes a reserve slot that a first attempt cannot take
        retry = asyncio.create_task(http.post("/run_code", json={"code": "echo retried", "language": "bash"},
                                              headers={"X-Sandbox-Retry": "1"}))
        while service.pool.waiting() < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert service.pool.waiting() == 2
        assert (await http.post("/run_code", json=body)).status_code == 503
        assert (await http.post("/run_code", json=body, headers={"X-Sandbox-Retry": "1"})).status_code == 503
        assert [r.status_code for r in await asyncio.gather(*slow)] == [200, 200]
        assert (await retry).json()["run_result"]["stdout"] == "retried\n"
    async with SandboxClient(tiny_server.url, ClientLimits(max_retries=8, backoff_base=0.2)) as client:
        outs = await asyncio.gather(*(client.run_code("echo ok", "bash") for _ in range(5)))
    assert [o.run_result.stdout for o in outs] == ["ok\n"] * 5  # retried through the 503s


def test_crashed_worker_is_replaced_and_reported(process_server, run):
    from concurrent.futures import ThreadPoolExecutor

    marker = f"{uuid.uuid4().int % 10**6}.5"
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(run, process_server, f"sleep {marker}", "bash")
        os.kill(agent_of(host_pid(f"sleep\0{marker}")), signal.SIGKILL)  # the sandbox's agent dies mid-run
        out = pending.result()
    assert out["status"] == "SandboxError" and "crashed" in out["message"] and "replaced" in out["message"]
    process_server.wait_idle()
    assert run(process_server, "print('next')")["run_result"]["stdout"] == "next\n"


async def test_a_client_that_keeps_breaking_its_sandbox_is_slowed_down_alone(server_thread_cls):
    """Crash-loop back-off: past ``crash_respawn_burst`` breaks, that client's next run waits until
    1 / ``crash_respawn_rate`` s after its last break (reported in ``queue_time``); another client does not."""
    settings = ServiceSettings(min_pool_size=2, max_pool_size=4, crash_respawn_rate=0.5, crash_respawn_burst=1)
    with server_thread_cls(ProcessBackend(memory_mb=256, tmpfs_mb=16), settings) as server:
        async with SandboxClient(server.url) as killer, SandboxClient(server.url) as bystander:
            assert killer.client_id != bystander.client_id
            t_break = 0.0
            for _ in range(2):  # two breaks within burst / rate = 2 s: a crash loop
                marker = f"{uuid.uuid4().int % 10**6}.{uuid.uuid4().int % 997}"
                pending = asyncio.ensure_future(killer.run_code(f"sleep {marker}", "bash", run_timeout=30))
                pid = await asyncio.to_thread(host_pid, f"sleep\0{marker}")
                os.kill(agent_of(pid), signal.SIGKILL)
                out = await pending
                t_break = time.monotonic()
                assert out.status.value == "SandboxError" and "crashed" in out.message, out
            other = await bystander.run_code("echo fine", "bash")
            again = await killer.run_code("echo again", "bash")
            waited = time.monotonic() - t_break
        health = httpx.get(f"{server.url}/v1/health").json()
    assert other.run_result.stdout == "fine\n" and other.queue_time < 0.5, other
    assert again.run_result.stdout == "again\n" and again.queue_time > 0.5, again
    assert waited >= 1.9  # 1 / rate after the last break
    assert health["stats"]["crash_backoff_delays"] == 1 and health["pool"]["recycled"] >= 2


async def test_client_retries_only_retryable_answers():
    """httpx.MockTransport stands in for a flaky server (a real one cannot fail on cue)."""
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if len(calls) == 1:
            raise httpx.ConnectError("refused")
        if len(calls) == 2:
            return httpx.Response(502, text="bad gateway")
        return httpx.Response(200, json={"status": "Failed", "message": "",
                                         "run_result": {"status": "Finished", "return_code": 1}})

    client = SandboxClient("http://sandbox", ClientLimits(backoff_base=0.01), transport=httpx.MockTransport(handler))
    out = await client.run_code("exit(1)")
    assert out.status.value == "Failed" and len(calls) == 3  # the program's failure is not retried
    dead = SandboxClient("http://sandbox", ClientLimits(max_retries=2, backoff_base=0.01),
                         transport=httpx.MockTransport(lambda r: httpx.Response(503)))
    with pytest.raises(SandboxUnavailable, match="after 3 attempts"):
        await dead.run_code("1")
    bad = SandboxClient("http://sandbox", transport=httpx.MockTransport(lambda r: httpx.Response(422, json={})))
    with pytest.raises(httpx.HTTPStatusError):
        await bad.run_code("1")


async def test_code_interpreter_tool(process_server):
    tool = SandboxFusionTool({"sandbox_fusion_url": f"{process_server.url}/run_code", "default_timeout": 2,
                              "num_workers": 4, "max_output_chars": 50, "enable_session": True})
    assert tool.name == "code_interpreter"
    iid = await tool.create()
    try:
        text, _, metrics = await tool.execute(iid, {"code": "x = 20\nprint(x + 1)"})
        assert text.text == "21\n" and metrics["status"] == "Success"
        assert (await tool.execute(iid, {"code": "print(x * 2)"}))[0].text == "40\n"  # same interpreter
        long = (await tool.execute(iid, {"code": "print('a' * 500)"}))[0].text
        assert long.startswith("a" * 50) and "truncated" in long
        slow = (await tool.execute(iid, {"code": "while True: pass"}))[0].text
        assert "timed out after 2 seconds" in slow
        err = (await tool.execute(iid, {"code": "1/0"}))[0].text
        assert "ZeroDivisionError" in err and err.startswith("stderr:")
        assert "sandbox error" in (await tool.execute(iid, {"code": "x", "language": "cobol"}))[0].text
    finally:
        await tool.release(iid)
    assert len(process_server.service.sessions) == 0


async def test_code_interpreter_tool_sessions_are_server_issued(process_server):
    """Parallel first calls of one trajectory share one server-issued session; release closes it."""
    tool = SandboxFusionTool({"sandbox_fusion_url": process_server.url, "enable_session": True})
    iid = await tool.create()
    try:
        outs = await asyncio.gather(*(tool.execute(iid, {"code": f"v{i} = {i}"}) for i in range(3)))
        assert [o[2]["status"] for o in outs] == ["Success"] * 3
        assert (await tool.execute(iid, {"code": "print(v0 + v1 + v2)"}))[0].text == "3\n"
        assert list(process_server.service.sessions._sessions) == [tool._instances[iid]]
    finally:
        await tool.release(iid)
    assert len(process_server.service.sessions) == 0


async def test_code_interpreter_tool_replaces_an_expired_session_once(server_thread_cls):
    """A session the server dropped (idle timeout here; a restarted server forgets them too) is not an
    infrastructure failure: the tool opens a new one, runs the call there and tells the model that its
    earlier state is gone; the calls after that use the new session as usual."""
    settings = ServiceSettings(min_pool_size=1, max_pool_size=2, session_idle_timeout=1.0, default_memory_mb=256)
    with server_thread_cls(ProcessBackend(memory_mb=256, tmpfs_mb=16), settings) as server:
        tool = SandboxFusionTool({"sandbox_fusion_url": server.url, "enable_session": True})
        iid = await tool.create()
        try:
            assert (await tool.execute(iid, {"code": "x = 1"}))[2]["status"] == "Success"
            first = tool._instances[iid]
            deadline = time.monotonic() + 10
            while len(server.service.sessions) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)  # the server closes the idle session
            assert len(server.service.sessions) == 0
            text, _, metrics = await tool.execute(iid, {"code": "y = 2\nprint(x)"})
            assert text.text.startswith("Note: the interpreter session had expired") and "NameError" in text.text
            assert metrics["session_lost"] and tool._instances[iid] not in (None, first)
            again, _, metrics = await tool.execute(iid, {"code": "print(y)"})
            assert again.text == "2\n" and "session_lost" not in metrics
        finally:
            await tool.release(iid)


async def test_tool_reports_unreachable_sandbox():
    """A sandbox that is down is an infrastructure failure (never the model's reward), not a tool message."""
    from verl_agent.protocol import ToolCall
    from verl_agent.tools import ToolSession
    from verl_agent.tools.errors import ToolUnavailable

    tool = SandboxFusionTool({"sandbox_fusion_url": "http://127.0.0.1:9"})
    tool.client.limits = ClientLimits(max_retries=0)
    with pytest.raises(ToolUnavailable, match="the sandbox is unavailable") as e:
        await tool.execute(await tool.create(), {"code": "print(1)"})
    assert e.value.cause == "sandbox_unavailable"
    async with ToolSession({"code_interpreter": tool}) as session:  # how the agent loop sees it
        result = await session.call(ToolCall("code_interpreter", {"code": "print(1)"}))
    assert not result.ok and result.infra == "sandbox_unavailable"


async def test_code_reward_stdio_and_function_cases(process_server):
    completion = "Here:\n```python\nimport sys\na, b = map(int, sys.stdin.read().split())\nprint(a + b)\n```"
    cases = [{"input": "1 2", "output": "3"}, {"input": "2 2", "output": "5"}, {"input": "x", "output": "1"}]
    result = await score_code(completion, cases, url=process_server.url)
    assert result.score == pytest.approx(1 / 3)
    assert [c.status for c in result.cases] == ["passed", "wrong_answer", "runtime_error"]
    fn = "```python\ndef add(a, b):\n    return a + b if a < 10 else None\n```"
    calls = [{"fn_name": "add", "args": [1, 2], "expected": 3}, {"fn_name": "add", "args": [10, 2], "expected": 12}]
    result = await score_code(fn, calls, url=process_server.url)
    assert result.score == 0.5 and [c.status for c in result.cases] == ["passed", "wrong_answer"]
    slow = await score_code("while True: pass", [{"input": "", "output": ""}], url=process_server.url, timeout=1)
    assert slow.cases[0].status == "timeout" and slow.score == 0.0


async def test_code_reward_function_verdict_cannot_be_faked(process_server):
    """A solution cannot pass a function-call test without returning the right value: printing a verdict
    and exiting, an always-True ``__eq__`` (also on an int subclass), a bool for an int and reading the
    expected value from the program's source all fail; a correct solution that prints, uses ``from __future__``
    and a ``__main__`` block passes, and so does one returning the right number as a float."""
    cases = [{"fn_name": "add", "args": [1, 2], "expected": 3}, {"fn_name": "add", "args": [5, 5], "expected": 10}]
    fakes = {
        "printed verdict": "import os\nprint('{\"ok\": true, \"got\": \"3\"}', flush=True)\nos._exit(0)",
        "always equal": "class A:\n    def __eq__(self, o):\n        return True\ndef add(a, b):\n    return A()",
        "int subclass": "class I(int):\n    def __eq__(self, o):\n        return True\ndef add(a, b):\n    return I(0)",
        "bool for int": "def add(a, b):\n    return True",
        "reads the program": "import re\nsrc = open('main.py').read()\n"  # the old harness held the case
                             "def add(a, b):\n    return int((re.findall(r'expected\\D*(\\d+)', src) + [0])[0])",
    }
    for name, code in fakes.items():
        result = await score_code(f"```python\n{code}\n```", cases, url=process_server.url)
        assert result.score == 0.0, (name, result)
    good = ("from __future__ import annotations\nimport sys\n"
            "def add(a: int, b: int) -> int:\n    print('debug', a, file=sys.stderr)\n    print('{\"ok\": false}')\n"
            "    return a + b\nif __name__ == '__main__':\n    print(add(1, 1))")
    result = await score_code(f"```python\n{good}\n```", cases, url=process_server.url)
    assert result.score == 1.0 and [c.detail for c in result.cases] == ["3", "10"], result
    as_float = await score_code("```python\ndef add(a, b):\n    return float(a + b)\n```", cases, url=process_server.url)
    assert as_float.score == 1.0, as_float  # 3.0 == 3, as Python and the datasets' checkers have it


async def test_code_reward_a_program_that_exits_early_is_a_runtime_error(process_server):
    """``sys.exit(0)`` before the function returns (after printing) is that case's runtime_error; a
    verdict of the wrong shape (even one carrying the nonce) is too, and never breaks the other cases."""
    early = "```python\ndef add(a, b):\n    return a + b\nprint(3)\nimport sys; sys.exit(0)\n```"
    cases = [{"fn_name": "add", "args": [1, 2], "expected": 3}, {"input": "", "output": "3"}]
    result = await score_code(early, cases, url=process_server.url)
    assert [c.status for c in result.cases] == ["runtime_error", "passed"], result
    assert "exited before the function returned" in result.cases[0].detail

    def handler(request: httpx.Request) -> httpx.Response:  # a server that tags odd verdicts with the nonce
        nonce = json.loads(json.loads(request.content)["stdin"])["nonce"]
        shape = {"1": '{"ok": 1, "got": "3"}', "2": "[true]", "3": '{"ok": true}'}[str(calls.pop())]
        return httpx.Response(200, json={"status": "Success", "run_result": {
            "status": "Finished", "return_code": 0, "stdout": f"{nonce}{shape}\n", "stderr": ""}})

    calls = [1, 2, 3]
    client = SandboxClient("http://sandbox", transport=httpx.MockTransport(handler))
    result = await score_code("def add(a, b): return a + b", [cases[0]] * 3, client=client)
    assert [c.status for c in result.cases] == ["runtime_error"] * 3 and result.score == 0.0, result


async def test_code_reward_raises_when_the_sandbox_fails(monkeypatch):
    """An unreachable sandbox, or one answering SandboxError, is an infrastructure failure: score_code
    raises (no 0.0 score), and the example's reward comes back as a per-sample reward error."""
    from verl_agent.reward import load_reward_fn

    dead = SandboxClient("http://127.0.0.1:9", ClientLimits(max_retries=0))
    case = [{"fn_name": "add", "args": [1, 2], "expected": 3}, {"input": "", "output": ""}]
    with pytest.raises(SandboxUnavailable, match="ConnectError"):
        await score_code("def add(a, b): return a + b", case, client=dead)
    broken = SandboxClient("http://sandbox", transport=httpx.MockTransport(lambda r: httpx.Response(
        200, json={"status": "SandboxError", "message": "sandbox verl-sbx-1 crashed"})))
    with pytest.raises(SandboxUnavailable, match="sandbox error: sandbox verl-sbx-1 crashed"):
        await score_code("print(1)", case[1:], client=broken)
    monkeypatch.setenv("SANDBOX_FUSION_URL", "http://127.0.0.1:9")
    reward = load_reward_fn(str(Path(__file__).parents[2] / "examples/code_interpreter/reward.py") + ":compute_score")
    out = await asyncio.to_thread(reward, data_source="code", solution_str="def add(a, b): return a + b",
                                  ground_truth=json.dumps(case[:1]))
    assert out.error and "SandboxUnavailable" in out.error and out.score == 0.0, out
