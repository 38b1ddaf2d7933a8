"""ToolSession: per-sample kwargs, guaranteed release, timeouts, concurrency, every bad-call path."""

import asyncio
import time

import pytest

from verl_agent.protocol import ToolCall
from verl_agent.tools import BaseTool, CalculatorTool, ToolResponse, ToolSession

COUNTER_SCHEMA = {
    "type": "function",
    "function": {
        "name": "counter",
        "description": "Add to a per-trajectory counter.",
        "parameters": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]},
    },
}


class CounterTool(BaseTool):
    """A real stateful tool: per-instance counter, logs every lifecycle call with its kwargs."""

    def __init__(self, config=None, tool_schema=None):
        super().__init__(config, tool_schema or COUNTER_SCHEMA)
        self.state: dict[str, dict] = {}
        self.log: list[tuple] = []

    async def create(self, instance_id=None, **kwargs):
        instance_id = await super().create(instance_id)
        self.state[instance_id] = {"total": kwargs.get("start", 0), "target": kwargs.get("target")}
        self.log.append(("create", kwargs))
        return instance_id

    async def execute(self, instance_id, parameters, **kwargs):
        self.log.append(("execute", kwargs))
        await asyncio.sleep(kwargs.get("delay", 0))
        if parameters["n"] < 0:
            raise ValueError("n must be >= 0")
        st = self.state[instance_id]
        st["total"] += parameters["n"] * kwargs.get("scale", 1)
        return ToolResponse(text=str(st["total"])), 0.1, {"total": float(st["total"])}

    async def calc_reward(self, instance_id, **kwargs):
        self.log.append(("calc_reward", kwargs))
        return kwargs.get("bonus", 0.0) + float(self.state[instance_id]["total"] == self.state[instance_id]["target"])

    async def release(self, instance_id, **kwargs):
        self.log.append(("release", kwargs))
        del self.state[instance_id]


async def test_all_four_kwargs_are_used():
    tool = CounterTool()
    kw = {
        "counter": {
            "create_kwargs": {"start": 10, "target": 16},
            "execute_kwargs": {"scale": 2},
            "calc_reward_kwargs": {"bonus": 0.5},
            "release_kwargs": {"why": "done"},
        }
    }
    async with ToolSession({"counter": tool}, kw, timeout=5) as s:
        r = await s.call(ToolCall("counter", {"n": 3}, id="c1"))
        assert (r.ok, r.text, r.reward, r.metrics, r.name) == (True, "16", 0.1, {"total": 16.0}, "counter")
        assert await s.calc_reward() == 1.5
    assert [e for e, _ in tool.log] == ["create", "execute", "calc_reward", "release"]
    assert [k for _, k in tool.log] == [{"start": 10, "target": 16}, {"scale": 2}, {"bonus": 0.5}, {"why": "done"}]
    assert tool.state == {}


async def test_schemas_for_the_chat_template():
    s = ToolSession({"counter": CounterTool(), "calculator": CalculatorTool()}, timeout=1)
    names = [d["function"]["name"] for d in s.schemas()]
    assert names == ["counter", "calculator"]
    assert s.schemas()[0] == COUNTER_SCHEMA


@pytest.mark.parametrize(
    "call, text",
    [
        (ToolCall("nope", {}), 'Error: unknown tool "nope"; available tools: "counter"'),
        (ToolCall("counter", "{'n': 1}"), 'Error: arguments of "counter" are not valid JSON'),
        (ToolCall("counter", {}), 'Error: missing required argument "n"'),
        (ToolCall("counter", {"n": "1"}), 'Error: argument "n": expected integer, got string'),
        (ToolCall("counter", ["n"]), "Error: arguments must be a JSON object, got array"),
        (ToolCall("counter", {"n": -1}), 'Error: tool "counter" failed: ValueError: n must be >= 0'),
    ],
)
async def test_bad_calls_become_error_messages(call, text):
    async with ToolSession({"counter": CounterTool()}, timeout=5) as s:
        r = await s.call(call)
        assert not r.ok and r.text.startswith(text), r.text
        ok = await s.call(ToolCall("counter", '{"n": 2}'))  # the trajectory goes on; JSON text is accepted
        assert (ok.ok, ok.text) == (True, "2")
        assert s.metrics() == {"tool_calls": 2.0, "tool_errors": 1.0, "tool_timeouts": 0.0}


async def test_no_arguments_means_an_empty_object():
    async with ToolSession({"counter": CounterTool()}, timeout=5) as s:
        r = await s.call(ToolCall("counter", None))
        assert (r.ok, r.text) == (False, 'Error: missing required argument "n"')


async def test_release_runs_on_exception_and_cancellation():
    tool = CounterTool()
    with pytest.raises(RuntimeError):
        async with ToolSession({"counter": tool}, timeout=5):
            raise RuntimeError("trajectory failed")
    assert tool.state == {}

    entered = asyncio.Event()

    async def trajectory():
        async with ToolSession({"counter": tool}, timeout=5) as s:
            entered.set()
            await s.call(ToolCall("counter", {"n": 1}))
            await asyncio.sleep(10)  # cancelled here, inside the session

    task = asyncio.create_task(trajectory())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.01)
    assert tool.state == {} and tool.log[-1][0] == "release"


async def test_timeout_is_per_call_and_does_not_stall_others():
    tool = CounterTool()
    slow = {"counter": {"execute_kwargs": {"delay": 30}}}
    start = time.monotonic()

    async def fast_one():
        async with ToolSession({"counter": tool}, timeout=5) as s:
            t0 = time.monotonic()
            r = await s.call(ToolCall("counter", {"n": 1}))
            return r, time.monotonic() - t0

    async def slow_one():
        async with ToolSession({"counter": tool}, slow, timeout=0.5) as s:
            return await s.call(ToolCall("counter", {"n": 1})), s.metrics()

    (slow_r, m), *fast = await asyncio.gather(slow_one(), *[fast_one() for _ in range(20)])
    assert not slow_r.ok and slow_r.text == 'Error: tool "counter" timed out after 0.5 s'
    assert m["tool_timeouts"] == 1.0
    assert all(r.ok and r.text == "1" and dt < 0.4 for r, dt in fast)  # generous bound: fast calls never waited
    assert time.monotonic() - start < 5
    assert tool.state == {}


async def test_hundreds_of_concurrent_instances_keep_separate_state():
    tool = CounterTool()

    async def trajectory(i):
        kw = {"counter": {"create_kwargs": {"start": i, "target": i + 6}, "execute_kwargs": {"delay": 0.001 * (i % 7)}}}
        async with ToolSession({"counter": tool}, kw, timeout=10) as s:
            outs = [await s.call(ToolCall("counter", {"n": n})) for n in (1, 2, 3)]
            return [o.text for o in outs], await s.calc_reward()

    results = await asyncio.gather(*[trajectory(i) for i in range(500)])
    for i, (texts, reward) in enumerate(results):
        assert texts == [str(i + 1), str(i + 3), str(i + 6)]
        assert reward == 1.0
    assert tool.state == {}
    assert sum(1 for e, _ in tool.log if e == "create") == sum(1 for e, _ in tool.log if e == "release") == 500


class BrokenTool(CounterTool):
    def __init__(self, fail: str, **kw):
        super().__init__(**kw)
        self.fail = fail

    async def create(self, instance_id=None, **kwargs):
        if self.fail == "create":
            raise ConnectionError("backend down")
        if self.fail == "create_tuple":  # verl >= 0.5 returns (instance_id, ToolResponse)
            return (await super().create(instance_id, **kwargs)), ToolResponse()
        return await super().create(instance_id, **kwargs)

    async def calc_reward(self, instance_id, **kwargs):
        if self.fail == "reward":
            raise RuntimeError("no reward")
        return 2.0

    async def release(self, instance_id, **kwargs):
        await super().release(instance_id, **kwargs)
        if self.fail == "release":
            raise RuntimeError("release failed")


async def test_failing_create_reward_release_are_contained():
    broken = BrokenTool("create")
    async with ToolSession({"counter": broken, "calculator": CalculatorTool()}, timeout=5) as s:
        r = await s.call(ToolCall("counter", {"n": 1}))
        assert not r.ok and r.text == 'Error: tool "counter" is unavailable: ConnectionError: backend down'
        assert r.infra == "tool_create_failed"  # our side failed, not the model
        ok = await s.call(ToolCall("calculator", {"expression": "1+1"}))
        assert ok.text == "2" and ok.infra is None
        with pytest.raises(RuntimeError, match='tool "counter": no reward: its create failed'):
            await s.calc_reward()  # never the other tools' sum as if nothing happened
    for fail, reward in (("release", 2.0), ("create_tuple", 2.0)):
        tool = BrokenTool(fail)
        async with ToolSession({"counter": tool}, timeout=5) as s:
            assert (await s.call(ToolCall("counter", {"n": 4}))).text == "4"
            assert await s.calc_reward() == reward
        assert tool.state == {}
    tool = BrokenTool("reward")  # a reward that cannot be computed is never a silent 0.0
    async with ToolSession({"counter": tool}, timeout=5) as s:
        await s.call(ToolCall("counter", {"n": 4}))
        with pytest.raises(RuntimeError, match='tool "counter": calc_reward failed: RuntimeError: no reward'):
            await s.calc_reward()
    assert tool.state == {}  # released all the same


async def test_tool_failures_are_classified():
    """Model mistakes are policy failures (infra None); crashes, timeouts and ToolUnavailable are infrastructure."""
    from verl_agent.tools.errors import ToolUnavailable

    class Flaky(CounterTool):
        mode = "crash"

        async def execute(self, instance_id, parameters, **kwargs):
            if self.mode == "crash":
                raise KeyError("bug in our tool")
            if self.mode == "down":
                raise ToolUnavailable("backend at 10.0.0.1 refused", cause="sandbox_unavailable")
            await asyncio.sleep(10)

    tool = Flaky()
    async with ToolSession({"counter": tool}, timeout=0.2) as s:
        bad_args = await s.call(ToolCall("counter", {"n": "not a number"}))
        assert not bad_args.ok and bad_args.infra is None
        assert (await s.call(ToolCall("nope", {}))).infra is None
        assert (await s.call(ToolCall("counter", {"n": 1}))).infra == "tool_crash"
        tool.mode = "down"
        down = await s.call(ToolCall("counter", {"n": 1}))
        assert down.infra == "sandbox_unavailable" and "10.0.0.1 refused" in down.text
        tool.mode = "hang"
        assert (await s.call(ToolCall("counter", {"n": 1}))).infra == "tool_timeout"


async def test_bad_session_arguments():
    with pytest.raises(ValueError, match="timeout must be > 0"):
        ToolSession({}, timeout=0)
    with pytest.raises(ValueError, match=r"tools_kwargs\['counter'\] must be a mapping"):
        ToolSession({}, {"counter": [1]})
    with pytest.raises(RuntimeError, match="outside"):
        await ToolSession({"counter": CounterTool()}).call(ToolCall("counter", {"n": 1}))


async def test_non_finite_rewards_are_failures_not_rewards():
    """A NaN or infinite reward from execute or calc_reward would poison its group's advantages: refused."""

    class Odd(CounterTool):
        value = float("nan")

        async def execute(self, instance_id, parameters, **kwargs):
            return "ok", self.value, {}

        async def calc_reward(self, instance_id, **kwargs):
            return self.value

    for value in (float("nan"), float("inf"), -float("inf")):
        tool = Odd()
        tool.value = value
        async with ToolSession({"counter": tool}, timeout=5) as s:
            r = await s.call(ToolCall("counter", {"n": 1}))
            assert not r.ok and r.infra == "tool_crash" and "non-finite reward" in r.text
            with pytest.raises(RuntimeError, match='tool "counter": calc_reward returned a non-finite value'):
                await s.calc_reward()
