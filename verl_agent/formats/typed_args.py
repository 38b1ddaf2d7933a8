"""Arguments that arrive as strings (Qwen3-Coder's ``<parameter=...>``, GLM-4.5's ``<arg_value>``, DeepSeek
V3.2's ``string="true"``) turned into the types the tool's JSON Schema declares.

A value that cannot be read as its declared type is an error naming the parameter, the function and the
type; it is never passed on as a string the tool did not ask for. A parameter the schema does not
declare (or a call of a tool with no schema) is read as JSON when it is valid JSON, else kept as text.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["ArgumentTypeError", "schemas_by_name", "typed_arguments", "typed_value"]


class ArgumentTypeError(ValueError):
    """A string argument that is not a value of its declared JSON Schema type."""


def schemas_by_name(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """{function name: its parameters' properties} from OpenAI tool schemas (dicts or pydantic models)."""
    out: dict[str, dict[str, Any]] = {}
    for t in tools or []:
        if hasattr(t, "model_dump"):
            t = t.model_dump(exclude_none=True)
        fn = t.get("function", t) if isinstance(t, Mapping) else None
        if isinstance(fn, Mapping) and isinstance(fn.get("name"), str):
            params = fn.get("parameters") or {}
            out[fn["name"]] = dict(params.get("properties") or {}) if isinstance(params, Mapping) else {}
    return out


def _types(schema: Mapping[str, Any]) -> list[str]:
    t = schema.get("type")
    if isinstance(t, str):
        return [t]
    if isinstance(t, list):
        return [x for x in t if isinstance(x, str)]
    for key in ("anyOf", "oneOf"):  # optional parameters are often {"anyOf": [{"type": T}, {"type": "null"}]}
        if isinstance(schema.get(key), list):
            return [x for s in schema[key] if isinstance(s, Mapping) for x in _types(s)]
    return []


def _as(kind: str, raw: str) -> Any:
    text = raw.strip()
    if kind == "string":
        return raw
    if kind == "integer":
        value = json.loads(text)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError
        return value
    if kind == "number":
        value = json.loads(text)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError
        return value
    if kind == "boolean":  # Qwen3-Coder's template writes Python's str(): True / False
        if text.lower() in ("true", "false"):
            return text.lower() == "true"
        raise ValueError
    if kind == "null":
        if text.lower() in ("null", "none"):
            return None
        raise ValueError
    value = json.loads(text)
    if kind == "object" and not isinstance(value, dict) or kind == "array" and not isinstance(value, list):
        raise ValueError
    return value


def typed_value(raw: str, schema: Mapping[str, Any] | None, param: str, function: str) -> Any:
    """`raw` as the type `schema` declares for parameter `param` of `function`; raises ArgumentTypeError."""
    kinds = _types(schema or {})
    if not kinds:
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    for kind in sorted(kinds, key=lambda k: k == "string"):  # a string is the last resort of a union
        try:
            return _as(kind, raw)
        except ValueError:
            continue
    raise ArgumentTypeError(f"parameter {param!r} of {function!r} must be {' or '.join(kinds)}, got {raw!r}")


def typed_arguments(raw: Mapping[str, str], function: str, schemas: Mapping[str, Mapping[str, Any]]
                    ) -> dict[str, Any]:  # fmt: skip
    """All of a call's string arguments typed by `function`'s schema; raises ArgumentTypeError."""
    props = schemas.get(function, {})
    return {k: typed_value(v, props.get(k), k, function) for k, v in raw.items()}
