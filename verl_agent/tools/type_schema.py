"""Python type hints -> JSON Schema, for `@tool` functions.

Covers what tool arguments are made of: str, int, float, bool, None, list/tuple/set
(with `items`), dict (with `additionalProperties` for the value type), Literal
(-> enum), Enum subclasses, Optional / unions (-> a type list or anyOf),
Annotated (the first str metadata becomes the description), and nested objects
as TypedDict, dataclasses or pydantic models. Anything else is a TypeError that
`function_schema` reports with the function and parameter named.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from typing import Any

__all__ = ["annotation_to_schema"]

_PRIMITIVES: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean", type(None): "null"}


def annotation_to_schema(tp: Any) -> dict[str, Any]:
    """JSON Schema for one annotation; raises TypeError for types a model cannot produce."""
    if tp in _PRIMITIVES:
        return {"type": _PRIMITIVES[tp]}
    if tp is Any:
        return {}
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:
        out = annotation_to_schema(args[0])
        docs = [a for a in args[1:] if isinstance(a, str)]
        if docs:
            out["description"] = docs[0]
        return out
    if origin is typing.Literal:
        kinds = sorted({_PRIMITIVES[type(a)] for a in args})
        return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": list(args)}
    if origin in (typing.Union, types.UnionType):
        return _union(args)
    if tp in (list, tuple, set, frozenset) or origin in (list, tuple, set, frozenset, typing.Sequence):
        return _array(origin or tp, args)
    if tp is dict or origin is dict:
        out: dict[str, Any] = {"type": "object"}
        if len(args) == 2 and args[1] is not Any:
            out["additionalProperties"] = annotation_to_schema(args[1])
        return out
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        values = [m.value for m in tp]
        return {**annotation_to_schema(typing.Literal[tuple(values)]), "enum": values}  # type: ignore[misc]
    if isinstance(tp, type):
        obj = _object(tp)
        if obj is not None:
            return obj
    raise TypeError(f"type {tp!r} has no JSON Schema form; use str, int, float, bool, list, dict, Literal, ...")


def _union(args: tuple[Any, ...]) -> dict[str, Any]:
    subs = [annotation_to_schema(a) for a in args]
    simple = [s for s in subs if set(s) == {"type"} and isinstance(s["type"], str)]
    if len(simple) == len(subs):
        return {"type": [s["type"] for s in subs]}
    return {"anyOf": subs}


def _array(origin: Any, args: tuple[Any, ...]) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "array"}
    item_args = [a for a in args if a is not Ellipsis]
    if len(set(item_args)) == 1:
        out["items"] = annotation_to_schema(item_args[0])
    elif item_args:
        out["items"] = _union(tuple(dict.fromkeys(item_args)))
    if origin is tuple and args and Ellipsis not in args:
        out["minItems"] = out["maxItems"] = len(args)
    return out


def _object(tp: type) -> dict[str, Any] | None:
    """Nested objects: TypedDict, dataclass or pydantic model; None if `tp` is none of them."""
    if typing.is_typeddict(tp):
        hints = typing.get_type_hints(tp)
        required = sorted(getattr(tp, "__required_keys__", hints))
        return _obj_schema(tp, {k: annotation_to_schema(v) for k, v in hints.items()}, required)
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        props, required = {}, []
        for f in dataclasses.fields(tp):
            props[f.name] = annotation_to_schema(hints[f.name])
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                required.append(f.name)
            elif f.default is not dataclasses.MISSING:
                props[f.name]["default"] = f.default
        return _obj_schema(tp, props, required)
    fields = getattr(tp, "model_fields", None)  # pydantic v2 model
    if isinstance(fields, dict):
        props, required = {}, []
        for name, f in fields.items():
            props[name] = annotation_to_schema(f.annotation)
            if f.description:
                props[name]["description"] = f.description
            if f.is_required():
                required.append(name)
        return _obj_schema(tp, props, required)
    return None


def _obj_schema(tp: type, props: dict[str, Any], required: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "object", "properties": props, "required": required}
    if tp.__doc__ and not tp.__doc__.startswith(tp.__name__ + "("):  # skip the auto dataclass doc
        out["description"] = tp.__doc__.strip().split("\n\n")[0]
    return out
