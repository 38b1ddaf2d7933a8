"""check_tool: a user's tool is run through the lifecycle once and broken rules are named."""

import pytest

from verl_agent.tools import BaseTool, CalculatorTool, ToolContractError, ToolResponse, check_tool, check_tool_async

SCHEMA = {
    "type": "function",
    "function": {"name": "t", "parameters": {"properties": {"q": {"type": "string"}}, "required": ["q"]}},
}


def make(**overrides):
    class T(BaseTool):
        async def execute(self, instance_id, parameters, **kwargs):
            return ToolResponse(text=parameters["q"]), 0.0, {}

    for name, fn in overrides.items():
        setattr(T, name, fn)
    return T({}, SCHEMA)


def test_sync_entry_point_on_a_good_tool():
    out = check_tool(make(), {"q": "hello"})
    assert out["response"].text == "hello" and out["reward"] == 0.0


@pytest.mark.parametrize(
    "overrides, fragment",
    [
        ({"execute": lambda self, i, p, **k: _coro("text")}, "execute must return (ToolResponse, reward, metrics)"),
        ({"execute": lambda self, i, p, **k: _coro(("x", 0.0, {}))}, "must be a ToolResponse, got str"),
        ({"execute": lambda self, i, p, **k: _coro((ToolResponse(), "1", {}))}, "step reward must be a number"),
        ({"execute": lambda self, i, p, **k: _coro((ToolResponse(), 0, []))}, "metrics must be a dict"),
        ({"create": lambda self, i=None, **k: _coro("same")}, "create('check-fixed-id') must return that id"),
        ({"create": lambda self, i=None, **k: _coro(None)}, "create(None) must return a new instance id"),
        ({"calc_reward": lambda self, i, **k: _coro("1")}, "calc_reward must return a number"),
    ],
)
async def test_broken_rules_are_named(overrides, fragment):
    with pytest.raises(ToolContractError) as e:
        await check_tool_async(make(**overrides), {"q": "x"})
    assert fragment in str(e.value)


async def test_name_must_match_schema():
    tool = CalculatorTool()
    tool.name = "calc"
    with pytest.raises(ToolContractError, match="tool.name 'calc' != schema name 'calculator'"):
        await check_tool_async(tool)


async def _coro(value):
    return value
