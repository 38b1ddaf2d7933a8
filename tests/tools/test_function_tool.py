"""@tool: schemas from type hints and docstrings, sync/async execution, hidden parameters, errors at definition."""

from __future__ import annotations

import asyncio
import datetime
import enum
import threading
from dataclasses import dataclass
from typing import Annotated, Literal, Optional, TypedDict

import pytest
from pydantic import BaseModel, Field

from verl_agent.protocol import ToolCall
from verl_agent.tools import FunctionTool, ToolConfigError, ToolResponse, ToolSession, check_tool_async, tool


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Address(TypedDict):
    city: str
    zip: int


@dataclass
class Point:
    x: float
    y: float = 0.0


class Box(BaseModel):
    """A box."""

    w: int = Field(description="width")
    h: int = 1


@tool
def kitchen_sink(
    name: str,
    count: int,
    ratio: float,
    flag: bool,
    tags: list[str],
    pair: tuple[int, int],
    scores: dict[str, float],
    mode: Literal["a", "b"],
    color: Color,
    address: Address,
    maybe: Optional[int] = None,  # noqa: UP045 - the old spelling must work too
    note: Annotated[str, "a short note"] = "",
    unit: str | None = "kg",
) -> str:
    """Exercise every supported type.

    Longer explanation that is not part of the description.

    Args:
        name: The name,
            continued on a second line.
        count (int): How many.
        unit: Unit of measure.

    Returns:
        Something.
    """
    return name


def test_schema_from_hints_and_docstring():
    fn = kitchen_sink.get_openai_tool_schema().to_openai()["function"]
    assert fn["name"] == "kitchen_sink"
    assert fn["description"] == "Exercise every supported type."
    p = fn["parameters"]
    assert p["required"] == ["name", "count", "ratio", "flag", "tags", "pair", "scores", "mode", "color", "address"]
    assert p["additionalProperties"] is False
    props = p["properties"]
    assert props["name"] == {"type": "string", "description": "The name, continued on a second line."}
    assert props["count"] == {"type": "integer", "description": "How many."}
    assert props["ratio"] == {"type": "number"} and props["flag"] == {"type": "boolean"}
    assert props["tags"] == {"type": "array", "items": {"type": "string"}}
    assert props["pair"] == {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2}
    assert props["scores"] == {"type": "object", "additionalProperties": {"type": "number"}}
    assert props["mode"] == {"type": "string", "enum": ["a", "b"]}
    assert props["color"] == {"type": "string", "enum": ["red", "blue"]}
    assert props["address"]["properties"] == {"city": {"type": "string"}, "zip": {"type": "integer"}}
    assert props["address"]["required"] == ["city", "zip"]
    assert props["maybe"] == {"type": ["integer", "null"], "default": None}
    assert props["note"] == {"type": "string", "description": "a short note", "default": ""}
    assert props["unit"] == {"type": ["string", "null"], "description": "Unit of measure.", "default": "kg"}


def test_sphinx_docstring_and_nested_models():
    @tool(name="place", description="Place a box.")
    def place(at: Point, box: Box) -> str:
        """:param at: where
        :param Box box: what
        """
        return f"{at.x},{at.y} {box.w}x{box.h}"

    fn = place.get_openai_tool_schema().to_openai()["function"]
    assert fn["description"] == "Place a box."
    at, box = fn["parameters"]["properties"]["at"], fn["parameters"]["properties"]["box"]
    assert at["description"] == "where" and at["required"] == ["x"] and at["properties"]["y"]["default"] == 0.0
    assert box["description"] == "what" and box["properties"]["w"]["description"] == "width"
    assert place(Point(1, 2), Box(w=3)) == "1,2 3x1"  # still callable as the function


async def test_nested_arguments_arrive_as_their_types():
    @tool
    def place(at: Point, box: Box) -> str:
        """Place a box."""
        return f"{at.x},{at.y} {box.w}x{box.h}"

    async with ToolSession({"place": place}, timeout=5) as s:
        r = await s.call(ToolCall("place", {"at": {"x": 1.5}, "box": {"w": 2}}))
    assert (r.ok, r.text) == (True, "1.5,0.0 2x1")

    @tool
    def paint(color: Color, n: int) -> str:
        """Paint n times."""
        return f"{color.name} {type(n).__name__} {n}"

    async with ToolSession({"paint": paint}, timeout=5) as s:  # an Enum arrives as its member, 3.0 as int 3
        r = await s.call(ToolCall("paint", {"color": "red", "n": 3.0}))
    assert (r.ok, r.text) == (True, "RED int 3")


class Opaque:  # no fields pydantic can describe
    pass


class Tree(BaseModel):
    """A tree."""

    label: str
    kids: list[Tree] = []


class Stay(TypedDict, total=False):
    nights: int


async def test_pydantic_types_recursion_constraints_and_typed_arguments():
    @tool
    def plan(tree: Tree, when: datetime.date, stay: Stay, pts: list[Point], size: Annotated[int, Field(ge=1)] = 1,
             pair: tuple[int, str] = (0, "a")) -> str:
        """Plan."""
        return f"{tree.kids[0].label} {when.year} {stay} {pts[0].x} {size} {pair!r}"

    p = plan.get_openai_tool_schema().to_openai()["function"]["parameters"]
    assert p["properties"]["tree"] == {"$ref": "#/$defs/Tree"}  # refers to itself: kept under $defs
    assert p["$defs"]["Tree"]["properties"]["kids"]["items"] == {"$ref": "#/$defs/Tree"}
    assert p["properties"]["when"] == {"type": "string", "format": "date"}
    assert p["properties"]["stay"] == {"type": "object", "properties": {"nights": {"type": "integer"}}}
    assert p["properties"]["pts"]["items"]["required"] == ["x"]  # a dataclass inlined, no "title"
    assert p["properties"]["size"] == {"type": "integer", "minimum": 1, "default": 1}
    assert p["properties"]["pair"]["prefixItems"] == [{"type": "integer"}, {"type": "string"}]
    args = {"tree": {"label": "r", "kids": [{"label": "k"}]}, "when": "2024-05-01", "stay": {},
            "pts": [{"x": 2.5}], "pair": [3, "b"]}
    async with ToolSession({"plan": plan}, timeout=5) as s:
        ok = await s.call(ToolCall("plan", args))
        low = await s.call(ToolCall("plan", {**args, "size": 0}))
        bad = await s.call(ToolCall("plan", {**args, "when": "May 1st"}))  # jsonschema checks format "date"
    assert (ok.ok, ok.text) == (True, "k 2024 {} 2.5 1 (3, 'b')")
    assert (low.ok, low.text) == (False, 'Error: argument "size": 0 is below the minimum 1')
    assert (bad.ok, bad.infra, bad.text) == (False, None, "Error: argument \"when\": 'May 1st' is not a valid date")


async def test_sync_functions_run_off_the_event_loop():
    seen = {}

    @tool
    def where_am_i() -> str:
        """Report the thread."""
        seen["thread"] = threading.current_thread() is threading.main_thread()
        return "ok"

    resp, _, _ = await where_am_i.execute("i", {})
    assert resp.text == "ok" and seen["thread"] is False


async def test_async_function_and_return_conversions():
    @tool
    async def multi(kind: str) -> object:
        """Return different things."""
        await asyncio.sleep(0)
        return {
            "str": "s",
            "int": 3,
            "float": 4.0,
            "dict": {"a": [1, "é"]},
            "none": None,
            "resp": ToolResponse(text="r"),
            "point": (48.85, 2.35, 35),  # a value that happens to have three parts: an answer, no reward
            "tuple": ("t", 0.5, {"m": 1.0}),  # verl's (response, reward, metrics)
        }[kind]

    expect = {"str": "s", "int": "3", "float": "4", "dict": '{"a": [1, "é"]}', "none": "", "resp": "r",
              "point": "[48.85, 2.35, 35]", "tuple": "t"}
    for kind, text in expect.items():
        resp, reward, metrics = await multi.execute("i", {"kind": kind})
        assert resp.text == text, kind
        assert (reward, metrics) == ((0.5, {"m": 1.0}) if kind == "tuple" else (0.0, {})), kind


async def test_hidden_parameters_come_from_instance_and_execute_kwargs():
    @tool(exclude=("secret",))
    def guess(value: int, secret: int, instance_id: str) -> str:
        """Guess the secret."""
        return f"{instance_id}:{'yes' if value == secret else 'no'}"

    props = guess.tool_schema.to_openai()["function"]["parameters"]["properties"]
    assert list(props) == ["value"]
    kwargs = {"guess": {"execute_kwargs": {"secret": 7}}}
    async with ToolSession({"guess": guess}, kwargs, timeout=5) as s:
        r = await s.call(ToolCall("guess", {"value": 7}))
        assert r.text == f"{s.instance_ids['guess']}:yes"
        r = await s.call(ToolCall("guess", {"value": 7, "secret": 7}))
        assert not r.ok and 'unknown argument "secret"' in r.text


def test_definition_errors_name_the_function():
    def no_doc(x: int) -> int:
        return x

    def no_hint(x) -> int:
        """Doc."""
        return x

    def bad_type(x: set[Opaque]) -> int:
        """Doc."""
        return 0

    def bad_default(x: int = object()) -> int:  # noqa: B008
        """Doc."""
        return x

    with pytest.raises(ToolConfigError, match=r"no_doc: needs a docstring"):
        tool(no_doc)
    with pytest.raises(ToolConfigError, match=r"no_hint: parameter 'x' needs a type hint"):
        tool(no_hint)
    with pytest.raises(ToolConfigError, match=r"bad_type: parameter 'x': type set\[.*Opaque\] has no JSON Schema form"):
        tool(bad_type)
    with pytest.raises(ToolConfigError, match=r"default of 'x' is not JSON-serialisable"):
        tool(bad_default)
    with pytest.raises(ToolConfigError, match="must match"):
        tool(name="bad name")(kitchen_sink.fn)


async def test_check_tool_on_a_function_tool():
    out = await check_tool_async(kitchen_sink)
    assert out["response"].text == "1"  # example_arguments fills strings with "1"
    assert isinstance(kitchen_sink, FunctionTool)
