"""`@tool`: a typed Python function (sync or async) with a docstring becomes a BaseTool.

    @tool
    def lookup(city: str, unit: Literal["C", "F"] = "C") -> str:
        '''Current temperature of a city.

        Args:
            city: City name, e.g. "Paris".
            unit: Temperature unit.
        '''

The schema comes from the signature (type hints -> JSON Schema, defaults ->
`default`, no default -> `required`) and the docstring (first paragraph ->
description, Google `Args:` or Sphinx `:param x:` lines -> property descriptions).
Sync functions run in a worker thread, so a slow one cannot stall other
trajectories. A parameter named `instance_id`, and any listed in `exclude=`, is
hidden from the model and filled from the instance id / the dataset's
`execute_kwargs`. The decorated object still calls like the function.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
from collections.abc import Callable
from typing import Any

from verl_agent.tools.base import BaseTool, ToolResponse
from pydantic import TypeAdapter, ValidationError

from verl_agent.tools.errors import ToolArgumentError, ToolConfigError
from verl_agent.tools.schema import OpenAIFunctionToolSchema
from verl_agent.tools.type_schema import annotation_to_schema, type_adapter

__all__ = ["FunctionTool", "tool", "function_schema"]

_ARG_LINE = re.compile(r"^\s*(?:[*]{0,2})(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")
_SPHINX = re.compile(r"^\s*:param\s+(?:[\w\[\], |]+\s+)?(\w+)\s*:\s*(.*)$")


def _parse_docstring(doc: str) -> tuple[str, dict[str, str]]:
    """(description, {param: description}) from a Google- or Sphinx-style docstring."""
    doc = inspect.cleandoc(doc)
    summary = doc.split("\n\n", 1)[0].strip()
    summary = " ".join(line.strip() for line in summary.splitlines())
    params: dict[str, str] = {}
    in_args, current, arg_indent = False, None, None
    for line in doc.splitlines():
        if m := _SPHINX.match(line):
            params[m.group(1)], current = m.group(2).strip(), m.group(1)
            continue
        if line.strip().lower() in ("args:", "arguments:", "parameters:"):
            in_args = True
            continue
        if not in_args:
            continue
        if line and not line[0].isspace():  # the next section ("Returns:") ends the Args block
            in_args = False
            continue
        indent = len(line) - len(line.lstrip())
        m = _ARG_LINE.match(line)
        if m and (arg_indent is None or indent <= arg_indent):
            current, arg_indent = m.group(1), indent
            params[current] = m.group(2).strip()
        elif current and line.strip():  # a continuation line
            params[current] = (params[current] + " " + line.strip()).strip()
    return summary, params


def function_schema(
    fn: Callable[..., Any], name: str | None = None, description: str | None = None, exclude: tuple[str, ...] = ()
) -> OpenAIFunctionToolSchema:
    """Build the OpenAI tool schema of `fn`; raises ToolConfigError naming the function and parameter."""
    where = f"@tool {getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', fn)}"
    if not (fn.__doc__ or description):
        raise ToolConfigError(f"{where}: needs a docstring (the model reads it as the tool description)")
    summary, arg_docs = _parse_docstring(fn.__doc__ or "")
    try:
        hints = inspect.get_annotations(fn, eval_str=True)
    except Exception as e:  # a forward reference that cannot be resolved
        raise ToolConfigError(f"{where}: cannot resolve type hints: {e}") from e
    props: dict[str, Any] = {}
    defs: dict[str, Any] = {}
    required: list[str] = []
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name in exclude or p.name == "instance_id":
            continue
        if p.name not in hints:
            raise ToolConfigError(f"{where}: parameter {p.name!r} needs a type hint")
        try:
            schema = annotation_to_schema(hints[p.name], defs)
        except TypeError as e:
            raise ToolConfigError(f"{where}: parameter {p.name!r}: {e}") from e
        if p.name in arg_docs:
            schema["description"] = arg_docs[p.name]
        if p.default is p.empty:
            required.append(p.name)
        else:
            schema["default"] = _jsonable_default(p.default, where, p.name)
        props[p.name] = schema
    parameters = {"type": "object", "properties": props, "required": required, "additionalProperties": False}
    if defs:  # types that refer to themselves
        parameters["$defs"] = defs
    fn_block = {"name": name or fn.__name__, "description": description or summary, "parameters": parameters}
    try:
        return OpenAIFunctionToolSchema.model_validate({"type": "function", "function": fn_block})
    except ValueError as e:
        raise ToolConfigError(f"{where}: invalid schema: {e}") from e


def _jsonable_default(v: Any, where: str, pname: str) -> Any:
    if hasattr(v, "value") and not isinstance(v, (int, float, str)):  # Enum members
        v = v.value
    try:
        json.dumps(v)
    except TypeError as e:
        raise ToolConfigError(f"{where}: default of {pname!r} is not JSON-serialisable: {v!r}") from e
    return v


def _to_response(result: Any) -> tuple[ToolResponse, float, dict[str, Any]]:
    """A function may return a str, a ToolResponse, any JSON-able value, or verl's (response, reward, metrics):
    a 3-tuple counts as that only with a str/ToolResponse, a number or None and a dict or None, so a tuple
    of values (a coordinate, a row) is an answer, not a reward."""
    if isinstance(result, tuple) and len(result) == 3 and _is_verl_triple(*result):
        resp, reward, metrics = result
        return _to_response(resp)[0], float(reward or 0.0), dict(metrics or {})
    if isinstance(result, tuple):
        result = list(result)
    if isinstance(result, ToolResponse):
        return result, 0.0, {}
    if isinstance(result, str):
        return ToolResponse(text=result), 0.0, {}
    if isinstance(result, float) and result.is_integer() and abs(result) < 1e15:
        return ToolResponse(text=str(int(result))), 0.0, {}
    if isinstance(result, (dict, list)):
        return ToolResponse(text=json.dumps(result, ensure_ascii=False)), 0.0, {}
    return ToolResponse(text="" if result is None else str(result)), 0.0, {}


def _is_verl_triple(resp: Any, reward: Any, metrics: Any) -> bool:
    number = reward is None or (isinstance(reward, (int, float)) and not isinstance(reward, bool))
    return isinstance(resp, (str, ToolResponse)) and number and (metrics is None or isinstance(metrics, dict))


def _converters(fn: Callable[..., Any], visible: list[str]) -> dict[str, TypeAdapter[Any]]:
    """pydantic adapters that turn the model's JSON arguments into the annotated types (dataclasses, models,
    Enums, tuples, ..., also nested); plain JSON types need none."""
    try:
        hints = inspect.get_annotations(fn, eval_str=True)
    except Exception:
        return {}
    plain = (str, int, float, bool, list, dict, Any)
    return {name: type_adapter(hints[name]) for name in visible if name in hints and hints[name] not in plain}


class FunctionTool(BaseTool):
    """A BaseTool that calls a Python function; built by `@tool` or from a YAML `class_name` naming a function."""

    def __init__(
        self,
        fn: Callable[..., Any],
        config: dict[str, Any] | None = None,
        tool_schema: OpenAIFunctionToolSchema | dict | None = None,
        exclude: tuple[str, ...] = (),
        name: str | None = None,
        description: str | None = None,
    ):
        self.fn = fn
        self.exclude = tuple(exclude)
        self._sig = inspect.signature(fn)
        self._accepts_any = any(p.kind == p.VAR_KEYWORD for p in self._sig.parameters.values())
        super().__init__(config, tool_schema or function_schema(fn, name, description, self.exclude))
        self._converters = _converters(fn, list(self.tool_schema.function.parameters.properties or {}))
        self.__doc__ = fn.__doc__
        self.__wrapped__ = fn

    def with_config(self, config: dict[str, Any] | None, tool_schema: Any = None) -> FunctionTool:
        """A copy with a YAML entry's config / schema override."""
        return FunctionTool(self.fn, config, tool_schema or self.tool_schema, self.exclude)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        call = dict(parameters)
        for k, v in kwargs.items():  # execute_kwargs fill hidden parameters (or **kwargs)
            if k in self._sig.parameters or self._accepts_any:
                call[k] = v
        for k, adapter in self._converters.items():  # JSON values -> the annotated types
            if k in parameters:
                try:
                    call[k] = adapter.validate_python(parameters[k])
                except ValidationError as e:  # a constraint the JSON Schema cannot state (a validator, ...)
                    raise ToolArgumentError(f'argument "{k}": {e.errors()[0]["msg"]}') from None
        if "instance_id" in self._sig.parameters:
            call["instance_id"] = instance_id
        if inspect.iscoroutinefunction(self.fn):
            result = await self.fn(**call)
        else:
            result = await asyncio.to_thread(self.fn, **call)
        return _to_response(result)


def tool(
    fn: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    description: str | None = None,
    exclude: tuple[str, ...] = (),
) -> Any:
    """Decorator: `@tool` or `@tool(name=..., description=..., exclude=(...))` -> FunctionTool."""

    def wrap(f: Callable[..., Any]) -> FunctionTool:
        return FunctionTool(f, exclude=exclude, name=name, description=description)

    return wrap(fn) if fn is not None else wrap
