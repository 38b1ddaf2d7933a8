"""Python type hints -> JSON Schema, for `@tool` functions, by pydantic's `TypeAdapter(...).json_schema()`.

Every type pydantic validates works: str, int, float, bool, None, lists/tuples/sets, dicts, Literal, Enum,
unions, TypedDict, dataclasses, pydantic models (recursive ones too), dates, UUIDs, `Annotated[int,
Field(ge=1)]` constraints, ... `Annotated[T, "text"]` (a plain string) becomes the description.

pydantic's output is then made compact, because the model reads it in every prompt: no "title" keys,
`$ref`s inlined unless a type refers to itself (those stay under the parameters' `$defs`), a union of plain
types as one type list (`{"type": ["integer", "null"]}`), a tuple of one item type as `items` with its
length bounds, and "type" first in each object.
"""

from __future__ import annotations

import copy
import sys
import types
import typing
from typing import Any

import typing_extensions
from pydantic import PydanticUserError, TypeAdapter

__all__ = ["annotation_to_schema", "type_adapter"]

# Keywords whose value is one schema, a list of schemas, or a mapping of names to schemas.
_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
        "unevaluatedItems", "unevaluatedProperties")
_MANY = ("anyOf", "oneOf", "allOf", "prefixItems")
_NAMED = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")


def annotation_to_schema(tp: Any, defs: dict[str, Any] | None = None) -> dict[str, Any]:
    """JSON Schema of one annotation; the definitions of self-referring types go into `defs` (to be placed
    under the parameters' "$defs"). Raises TypeError for a type pydantic cannot describe."""
    docs = None
    if typing.get_origin(tp) is typing.Annotated:
        docs = next((a for a in typing.get_args(tp)[1:] if isinstance(a, str)), None)
    try:
        raw = type_adapter(tp).json_schema()
    except (PydanticUserError, TypeError, ValueError, NameError) as e:
        raise TypeError(f"type {tp!r} has no JSON Schema form: {e}") from None
    local = raw.pop("$defs", {})
    recursive = {n for n in local if _reaches(n, n, local, set())}
    out = _compact(_inline(raw, local, recursive))
    for name in recursive:
        body = _compact(_inline(local[name], local, recursive))
        if defs is not None and defs.setdefault(name, body) != body:
            raise TypeError(f"two different types are named {name!r}; rename one")
    if docs:
        out["description"] = docs
    return out


def type_adapter(tp: Any) -> TypeAdapter[Any]:
    """The pydantic adapter of an annotation (what `@tool` uses to turn JSON arguments into typed values)."""
    return TypeAdapter(_pydantic_ready(tp))


def _pydantic_ready(tp: Any) -> Any:
    """pydantic refuses `typing.TypedDict` before Python 3.12: rebuild such classes (also nested in
    generics and in other TypedDicts) as `typing_extensions.TypedDict` with the same keys."""
    if sys.version_info >= (3, 12):
        return tp
    if typing.is_typeddict(tp) and type(tp).__module__ == "typing":
        hints = typing.get_type_hints(tp, include_extras=True)
        required = getattr(tp, "__required_keys__", set(hints))
        fields = {k: _pydantic_ready(v) if k in required else typing_extensions.NotRequired[_pydantic_ready(v)]
                  for k, v in hints.items()}
        new = typing_extensions.TypedDict(tp.__name__, fields)  # type: ignore[operator]
        new.__doc__ = tp.__doc__
        return new
    args = typing.get_args(tp)
    if not args:
        return tp
    ready = tuple(_pydantic_ready(a) for a in args)
    if ready == args:
        return tp
    origin = typing.get_origin(tp)
    if origin is typing.Annotated:
        return typing.Annotated[(ready[0], *args[1:])]  # type: ignore[return-value]
    if origin in (typing.Union, types.UnionType):
        return typing.Union[ready]  # type: ignore[return-value]
    return tp.copy_with(ready) if hasattr(tp, "copy_with") else types.GenericAlias(origin, ready)


def _ref_name(node: dict[str, Any]) -> str | None:
    ref = node.get("$ref")
    return ref.rsplit("/", 1)[-1] if isinstance(ref, str) and ref.startswith("#/$defs/") else None


def _children(node: Any) -> list[Any]:
    if not isinstance(node, dict):
        return []
    out = [node[k] for k in _ONE if isinstance(node.get(k), dict)]
    out += [s for k in _MANY for s in node.get(k) or []]
    out += [s for k in _NAMED for s in (node.get(k) or {}).values()]
    return out


def _reaches(start: str, target: str, local: dict[str, Any], seen: set[str]) -> bool:
    stack = [local.get(start, {})]
    while stack:
        node = stack.pop()
        name = _ref_name(node) if isinstance(node, dict) else None
        if name == target:
            return True
        if name and name not in seen:
            seen.add(name)
            stack.append(local.get(name, {}))
        stack.extend(_children(node))
    return False


def _inline(node: Any, local: dict[str, Any], recursive: set[str]) -> Any:
    """Replace references to types that do not refer to themselves by a copy of their schema."""
    if not isinstance(node, dict):
        return node
    name = _ref_name(node)
    if name and name not in recursive:
        siblings = {k: v for k, v in node.items() if k != "$ref"}
        return _inline({**copy.deepcopy(local[name]), **siblings}, local, recursive)
    out = dict(node)
    for k in _ONE:
        if isinstance(out.get(k), dict):
            out[k] = _inline(out[k], local, recursive)
    for k in _MANY:
        if isinstance(out.get(k), list):
            out[k] = [_inline(s, local, recursive) for s in out[k]]
    for k in _NAMED:
        if isinstance(out.get(k), dict):
            out[k] = {n: _inline(s, local, recursive) for n, s in out[k].items()}
    return out


def _compact(node: Any) -> Any:
    """No titles, plain unions as a type list, one-type tuples as `items`, "type" first."""
    if not isinstance(node, dict):
        return node
    out = {k: v for k, v in node.items() if k != "title"}
    for k in _ONE:
        if isinstance(out.get(k), dict):
            out[k] = _compact(out[k])
    for k in _MANY:
        if isinstance(out.get(k), list):
            out[k] = [_compact(s) for s in out[k]]
    for k in _NAMED:
        if isinstance(out.get(k), dict):
            out[k] = {n: _compact(s) for n, s in out[k].items()}
    alts = out.get("anyOf")
    if isinstance(alts, list) and alts and all(set(a) == {"type"} and isinstance(a["type"], str) for a in alts):
        del out["anyOf"]
        out = {"type": [a["type"] for a in alts], **out}
    prefix = out.get("prefixItems")
    if isinstance(prefix, list) and prefix and "items" not in out and all(p == prefix[0] for p in prefix):
        first = {"items": out.pop("prefixItems")[0], "minItems": out.pop("minItems", None),
                 "maxItems": out.pop("maxItems", None)}
        out = {**{k: v for k, v in first.items() if v is not None}, **out}
    if "type" in out:
        out = {"type": out["type"], **{k: v for k, v in out.items() if k != "type"}}
    return out
