"""OpenAI function-calling schemas (pydantic) and argument validation (jsonschema).

The models accept verl's `tool_schema` block as is:
`{type: function, function: {name, description, parameters}}`, where `parameters`
is a JSON Schema object (draft 2020-12 unless it names another `$schema`). The
schema is checked against its draft's meta-schema when it is loaded; the keywords
function-calling schemas use most have typed fields, every other keyword
(`$ref`/`$defs`, `oneOf`, `allOf`, `pattern`, `format`, `const`, ...) is kept as written.

`validate_arguments` checks the model's arguments with `jsonschema` before `execute`
runs, for every keyword, and fills in declared defaults; its errors are phrased for
the model, because the agent loop sends them back as the tool message.
"""

from __future__ import annotations

import copy
import functools
import json
import re
from typing import Any, Literal

from jsonschema import Draft202012Validator
from jsonschema.exceptions import ValidationError as JsonSchemaError
from jsonschema.exceptions import best_match
from jsonschema.validators import validator_for
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from verl_agent.tools.errors import ToolArgumentError

__all__ = [
    "JSONSchema",
    "OpenAIFunctionParametersSchema",
    "OpenAIFunctionSchema",
    "OpenAIFunctionToolSchema",
    "validate_arguments",
]

JSON_TYPES = ("string", "number", "integer", "boolean", "array", "object", "null")
_COMPOSING = {"allOf", "anyOf", "oneOf", "$ref", "patternProperties", "dependentSchemas", "if"}
_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class JSONSchema(BaseModel):
    """One JSON Schema node (a property, an array's items, a nested object)."""

    model_config = ConfigDict(extra="allow")

    type: str | list[str] | None = None
    description: str | None = None
    enum: list[Any] | None = None
    default: Any = None
    items: JSONSchema | bool | None = None
    properties: dict[str, JSONSchema | bool] | None = None  # true/false are schemas too (any / nothing)
    required: list[str] | None = None
    additionalProperties: bool | JSONSchema | None = None
    anyOf: list[JSONSchema | bool] | None = None
    minimum: float | None = None
    maximum: float | None = None
    minLength: int | None = None
    maxLength: int | None = None
    minItems: int | None = None
    maxItems: int | None = None
    _validator: Any = PrivateAttr(default=None)  # built on the first validate_arguments

    @field_validator("type")
    @classmethod
    def _known_type(cls, v: str | list[str] | None) -> str | list[str] | None:
        for t in [v] if isinstance(v, str) else v or []:
            if t not in JSON_TYPES:
                raise ValueError(f"unknown JSON Schema type {t!r}; expected one of {JSON_TYPES}")
        return v

    @model_validator(mode="after")
    def _required_are_declared(self) -> JSONSchema:
        # A typo in a hand-written schema; composed schemas may declare the property in another branch.
        composed = set(self.model_extra or {}) & _COMPOSING
        if self.required and self.properties is not None and not composed:
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
    properties: dict[str, JSONSchema | bool] | None = Field(default_factory=dict)
    required: list[str] | None = Field(default_factory=list)

    @field_validator("type")
    @classmethod
    def _is_object(cls, v: Any) -> Any:
        if v != "object":
            raise ValueError(f"function 'parameters' must have type 'object', got {v!r}")
        return v

    @model_validator(mode="after")
    def _valid_json_schema(self) -> OpenAIFunctionParametersSchema:
        problem = _schema_problem(json.dumps(self.to_dict(), sort_keys=True, default=str))
        if problem is not None:
            raise ValueError(problem)
        return self

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out["type"] = "object"
        out.setdefault("properties", {k: p if isinstance(p, bool) else p.to_dict()
                                      for k, p in (self.properties or {}).items()})
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


@functools.cache
def _meta_validator(cls: Any) -> Any:
    """The validator of a draft's meta-schema (what `check_schema` builds on every call), built once."""
    return validator_for(cls.META_SCHEMA, default=cls)(cls.META_SCHEMA, format_checker=cls.FORMAT_CHECKER)


@functools.lru_cache(maxsize=4096)
def _schema_problem(text: str) -> str | None:
    """Why a schema (as JSON text) breaks its draft's meta-schema, or None; a tool built again is checked once."""
    schema = json.loads(text)
    error = best_match(_meta_validator(validator_for(schema, default=Draft202012Validator)).iter_errors(schema))
    if error is None:
        return None
    where = "/".join(str(p) for p in error.absolute_path) or "the top level"
    return f"not a valid JSON Schema at {where}: {error.message}"


def validate_arguments(parameters: JSONSchema, arguments: Any) -> dict[str, Any]:
    """Check `arguments` against `parameters` with `jsonschema` (every keyword of the schema's draft, 2020-12
    by default; formats that need no extra package are checked); return a copy with declared defaults filled
    in and integer-valued floats given as integers where only an integer fits.

    Raises ToolArgumentError listing every problem, e.g. `missing required argument "expression"`.
    """
    if not isinstance(arguments, dict):
        raise ToolArgumentError(f"arguments must be a JSON object, got {_json_type(arguments)}")
    if parameters._validator is None:
        schema = _false_as_not(parameters.to_dict())
        cls = validator_for(schema, default=Draft202012Validator)
        parameters._validator = cls(schema, format_checker=cls.FORMAT_CHECKER)
    validator = parameters._validator
    schema = validator.schema
    errors = [msg for err in validator.iter_errors(arguments) for msg in _messages(err)]
    if errors:
        raise ToolArgumentError("; ".join(dict.fromkeys(errors)))
    return _fill(schema, copy.deepcopy(arguments), schema)


def _false_as_not(node: Any) -> Any:
    """A property schema `false` as `{"not": {}}`: the same meaning, and jsonschema then names the argument."""
    if isinstance(node, list):
        return [_false_as_not(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _false_as_not(v) for k, v in node.items() if k not in ("properties", "enum", "const", "default")}
    if isinstance(node.get("properties"), dict):
        out["properties"] = {k: {"not": {}} if v is False else _false_as_not(v) for k, v in node["properties"].items()}
    return {**{k: node[k] for k in node if k in ("enum", "const", "default")}, **out}


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


def _path(parts: Any) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out


def _where(path: str) -> str:
    return f'argument "{path}"' if path else "arguments"


def _messages(err: JsonSchemaError) -> list[str]:
    """One jsonschema error in the model-facing words (the keywords a model trips over most have their own)."""
    path, v, kw, val = _path(err.absolute_path), err.instance, err.validator, err.validator_value
    prefix = f"{path}." if path else ""
    if kw == "required":
        return [f'missing required argument "{prefix}{name}"' for name in val if name not in v]
    if kw == "additionalProperties" and val is False:
        props = err.schema.get("properties") or {}
        patterns = list((err.schema.get("patternProperties") or {}))
        allowed = ", ".join(f'"{p}"' for p in props) or "none"
        extra = [k for k in v if k not in props and not any(re.search(p, k) for p in patterns)]
        return [f'unknown argument "{prefix}{k}" (allowed: {allowed})' for k in extra]
    if kw in ("anyOf", "oneOf"):
        return [f"{_where(path)}: {_alternatives(err)}"]
    return [f"{_where(path)}: {_SHORT[kw](v, val) if kw in _SHORT else err.message}"]


def _alternatives(err: JsonSchemaError) -> str:
    """anyOf/oneOf: none of the forms fits (with the closest form's problem), or, for oneOf, several do."""
    if not err.context:
        return f"{_json_type(err.instance)} matches more than one of the allowed forms (oneOf)"
    branches: dict[Any, list[JsonSchemaError]] = {}
    for sub in err.context:
        branches.setdefault(sub.relative_schema_path[0], []).append(sub)
    # the closest form is one of the right type: its own problem says what to change
    same_type = [e for es in branches.values() if not any(x.validator == "type" and not x.relative_path for x in es)
                 for e in es]
    closest = best_match(same_type) if same_type else None
    detail = _messages(closest)[0] if closest is not None else ""
    if closest is not None and list(closest.absolute_path) == list(err.absolute_path) and ": " in detail:
        detail = detail.split(": ", 1)[1]  # the same argument: said once
    return f"{_json_type(err.instance)} matches none of the allowed forms" + (f" (closest: {detail})" if detail else "")


_SHORT: dict[str, Any] = {
    "type": lambda v, t: f"expected {' or '.join([t] if isinstance(t, str) else t)}, got {_json_type(v)}",
    "enum": lambda v, e: f"{v!r} is not one of {e}",
    "const": lambda v, c: f"{v!r} is not the allowed value {c!r}",
    "minimum": lambda v, m: f"{v} is below the minimum {m:g}",
    "maximum": lambda v, m: f"{v} is above the maximum {m:g}",
    "minLength": lambda v, n: f"shorter than {n} characters",
    "maxLength": lambda v, n: f"longer than {n} characters",
    "minItems": lambda v, n: f"needs at least {n} items, got {len(v)}",
    "maxItems": lambda v, n: f"allows at most {n} items, got {len(v)}",
    "pattern": lambda v, p: f"{v!r} does not match the pattern {p!r}",
    "format": lambda v, f: f"{v!r} is not a valid {f}",
    "not": lambda v, n: "is not allowed" if n == {} else f"{_json_type(v)} is of a form that is not allowed",
}


def _resolve(node: Any, root: dict[str, Any]) -> Any:
    """Follow local `$ref`s ("#/$defs/X"); other references are left to the validator (no defaults there)."""
    seen = 0
    while isinstance(node, dict) and isinstance(node.get("$ref"), str) and node["$ref"].startswith("#/") and seen < 32:
        target: Any = root
        for part in node["$ref"][2:].split("/"):
            target = target.get(part.replace("~1", "/").replace("~0", "~"), {}) if isinstance(target, dict) else {}
        node, seen = target, seen + 1
    return node


def _fill(node: Any, value: Any, root: dict[str, Any]) -> Any:
    """Defaults of absent properties, recursively; 3.0 -> 3 where the schema wants an integer (not a number)."""
    node = _resolve(node, root)
    if not isinstance(node, dict):
        return value
    for part in node.get("allOf") or []:
        value = _fill(part, value, root)
    types = node.get("type")
    types = [types] if isinstance(types, str) else types or []
    if isinstance(value, float) and value.is_integer() and "integer" in types and "number" not in types:
        return int(value)
    if isinstance(value, dict):
        for name, sub in (node.get("properties") or {}).items():
            if name in value:
                value[name] = _fill(sub, value[name], root)
            elif isinstance(sub, dict) and "default" in (holder := sub if "default" in sub else _resolve(sub, root)):
                value[name] = copy.deepcopy(holder["default"])
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        value = [_fill(node["items"], x, root) for x in value]
    return value
