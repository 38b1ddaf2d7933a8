"""OpenAI function-calling schemas (pydantic) and argument validation.

The models accept verl's `tool_schema` block as is:
`{type: function, function: {name, description, parameters}}`, where `parameters`
is a JSON Schema object. The JSON Schema subset covered is what function-calling
models are given in practice: `type` (one or a list), `properties`, `required`,
`items`, `enum`, `default`, `additionalProperties`, `anyOf`, numeric and length
bounds. Other keywords are kept (and passed to the chat template) but not checked.

`validate_arguments` checks the model's arguments before `execute` runs and fills
in declared defaults; its errors are phrased for the model, because the agent loop
sends them back as the tool message.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from verl_agent.tools.errors import ToolArgumentError

__all__ = [
    "JSONSchema",
    "OpenAIFunctionParametersSchema",
    "OpenAIFunctionSchema",
    "OpenAIFunctionToolSchema",
    "validate_arguments",
]

JSON_TYPES = ("string", "number", "integer", "boolean", "array", "object", "null")
_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class JSONSchema(BaseModel):
    """One JSON Schema node (a property, an array's items, a nested object)."""

    model_config = ConfigDict(extra="allow")

    type: str | list[str] | None = None
    description: str | None = None
    enum: list[Any] | None = None
    default: Any = None
    items: JSONSchema | None = None
    properties: dict[str, JSONSchema] | None = None
    required: list[str] | None = None
    additionalProperties: bool | JSONSchema | None = None
    anyOf: list[JSONSchema] | None = None
    minimum: float | None = None
    maximum: float | None = None
    minLength: int | None = None
    maxLength: int | None = None
    minItems: int | None = None
    maxItems: int | None = None

    @field_validator("type")
    @classmethod
    def _known_type(cls, v: str | list[str] | None) -> str | list[str] | None:
        for t in [v] if isinstance(v, str) else v or []:
            if t not in JSON_TYPES:
                raise ValueError(f"unknown JSON Schema type {t!r}; expected one of {JSON_TYPES}")
        return v

    @model_validator(mode="after")
    def _required_are_declared(self) -> JSONSchema:
        if self.required and self.properties is not None:
            missing = [r for r in self.required if r not in self.properties]
            if missing:
                raise ValueError(f"'required' names {missing} that are not in 'properties'")
        return self

    def to_dict(self) -> dict[str, Any]:
        """The schema as written (only keys that were set), ready for a chat template."""
        return self.model_dump(mode="json", exclude_unset=True)


class OpenAIFunctionParametersSchema(JSONSchema):
    """The `parameters` object of a function: always a JSON Schema of type object."""

    type: str | list[str] | None = "object"
    properties: dict[str, JSONSchema] | None = Field(default_factory=dict)
    required: list[str] | None = Field(default_factory=list)

    @field_validator("type")
    @classmethod
    def _is_object(cls, v: Any) -> Any:
        if v != "object":
            raise ValueError(f"function 'parameters' must have type 'object', got {v!r}")
        return v

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out["type"] = "object"
        out.setdefault("properties", {k: p.to_dict() for k, p in (self.properties or {}).items()})
        out.setdefault("required", list(self.required or []))
        return out


class OpenAIFunctionSchema(BaseModel):
    """`function` block: name, description, parameters."""

    model_config = ConfigDict(extra="allow")

    name: str
    description: str = ""
    parameters: OpenAIFunctionParametersSchema = Field(default_factory=OpenAIFunctionParametersSchema)
    strict: bool = False

    @field_validator("name")
    @classmethod
    def _valid_name(cls, v: str) -> str:
        if not _NAME_RE.match(v):
            raise ValueError(f"function name {v!r} must match {_NAME_RE.pattern} (OpenAI function-calling rule)")
        return v


class OpenAIFunctionToolSchema(BaseModel):
    """verl's `tool_schema`: `{type: function, function: {...}}`."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function"] = "function"
    function: OpenAIFunctionSchema

    def to_openai(self) -> dict[str, Any]:
        """The plain dict chat templates and OpenAI-style APIs expect."""
        fn: dict[str, Any] = {"name": self.function.name, "description": self.function.description}
        fn["parameters"] = self.function.parameters.to_dict()
        if self.function.strict:
            fn["strict"] = True
        return {"type": "function", "function": fn}


def validate_arguments(parameters: JSONSchema, arguments: Any) -> dict[str, Any]:
    """Check `arguments` against `parameters`; return a copy with declared defaults filled in.

    Raises ToolArgumentError listing every problem, e.g.
    `missing required argument "expression"`.
    """
    if not isinstance(arguments, dict):
        raise ToolArgumentError(f"arguments must be a JSON object, got {_json_type(arguments)}")
    errors: list[str] = []
    out = _check(parameters, arguments, "", errors)
    if errors:
        raise ToolArgumentError("; ".join(errors))
    return out


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    if isinstance(v, dict):
        return "object"
    return type(v).__name__


def _type_ok(expected: str, v: Any) -> bool:
    actual = _json_type(v)
    if expected == "number":
        return actual in ("number", "integer")
    if expected == "integer" and actual == "number":
        return float(v).is_integer()  # 3.0 is a valid integer in JSON Schema
    return actual == expected


def _where(path: str) -> str:
    return f'argument "{path}"' if path else "arguments"


def _check(s: JSONSchema, v: Any, path: str, errors: list[str]) -> Any:
    """Validate one node; returns the value (objects get defaults filled in)."""
    if s.anyOf:
        for alt in s.anyOf:
            sub: list[str] = []
            res = _check(alt, v, path, sub)
            if not sub:
                return res
        errors.append(f"{_where(path)}: {_json_type(v)} matches none of the allowed forms")
        return v
    types = [s.type] if isinstance(s.type, str) else s.type
    if types and not any(_type_ok(t, v) for t in types):
        errors.append(f"{_where(path)}: expected {' or '.join(types)}, got {_json_type(v)}")
        return v
    if s.enum is not None and v not in s.enum:
        errors.append(f"{_where(path)}: {v!r} is not one of {s.enum}")
    if isinstance(v, bool):
        return v
    if isinstance(v, float) and "integer" in types and "number" not in types:
        v = int(v)  # accepted as an integer (3.0): handed on as one
    if isinstance(v, (int, float)):
        if s.minimum is not None and v < s.minimum:
            errors.append(f"{_where(path)}: {v} is below the minimum {s.minimum:g}")
        if s.maximum is not None and v > s.maximum:
            errors.append(f"{_where(path)}: {v} is above the maximum {s.maximum:g}")
    elif isinstance(v, str):
        if s.minLength is not None and len(v) < s.minLength:
            errors.append(f"{_where(path)}: shorter than {s.minLength} characters")
        if s.maxLength is not None and len(v) > s.maxLength:
            errors.append(f"{_where(path)}: longer than {s.maxLength} characters")
    elif isinstance(v, list):
        return _check_array(s, v, path, errors)
    elif isinstance(v, dict):
        return _check_object(s, v, path, errors)
    return v


def _check_array(s: JSONSchema, v: list, path: str, errors: list[str]) -> list:
    if s.minItems is not None and len(v) < s.minItems:
        errors.append(f"{_where(path)}: needs at least {s.minItems} items, got {len(v)}")
    if s.maxItems is not None and len(v) > s.maxItems:
        errors.append(f"{_where(path)}: allows at most {s.maxItems} items, got {len(v)}")
    if s.items is None:
        return v
    return [_check(s.items, x, f"{path}[{i}]", errors) for i, x in enumerate(v)]


def _check_object(s: JSONSchema, v: dict, path: str, errors: list[str]) -> dict:
    props = s.properties or {}
    prefix = f"{path}." if path else ""
    out: dict[str, Any] = {}
    for name in s.required or []:
        if name not in v:
            errors.append(f'missing required argument "{prefix}{name}"')
    for key, val in v.items():
        if key in props:
            out[key] = _check(props[key], val, prefix + key, errors)
        elif s.additionalProperties is False:
            allowed = ", ".join(f'"{p}"' for p in props) or "none"
            errors.append(f'unknown argument "{prefix}{key}" (allowed: {allowed})')
        elif isinstance(s.additionalProperties, JSONSchema):
            out[key] = _check(s.additionalProperties, val, prefix + key, errors)
        else:
            out[key] = val
    for name, p in props.items():
        if name not in out and name not in v and "default" in p.model_fields_set:
            out[name] = p.default
    return out
