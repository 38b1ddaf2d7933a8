"""OpenAI tool schema models and argument validation (every bad-argument path the model can produce)."""

import pytest
from pydantic import ValidationError

from verl_agent.tools import OpenAIFunctionToolSchema, ToolArgumentError, validate_arguments

SCHEMA = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search documents.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "minLength": 1},
                "limit": {"type": "integer", "default": 5, "minimum": 1, "maximum": 50},
                "mode": {"type": "string", "enum": ["fast", "exact"]},
                "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
                "filter": {
                    "type": "object",
                    "properties": {"year": {"type": "integer"}, "lang": {"type": ["string", "null"]}},
                    "required": ["year"],
                    "additionalProperties": False,
                },
            },
            "required": ["query"],
        },
    },
}


@pytest.fixture
def params():
    return OpenAIFunctionToolSchema.model_validate(SCHEMA).function.parameters


def test_round_trip_keeps_the_schema_as_written():
    s = OpenAIFunctionToolSchema.model_validate(SCHEMA)
    assert s.to_openai() == SCHEMA


def test_valid_arguments_get_defaults(params):
    out = validate_arguments(params, {"query": "x", "filter": {"year": 2020, "lang": None}, "tags": ["a"]})
    assert out == {"query": "x", "limit": 5, "filter": {"year": 2020, "lang": None}, "tags": ["a"]}


def test_integer_valued_float_is_an_integer_and_int_is_a_number(params):
    assert validate_arguments(params, {"query": "x", "limit": 3.0})["limit"] == 3.0


@pytest.mark.parametrize(
    "args, message",
    [
        ({}, 'missing required argument "query"'),
        ({"query": 3}, 'argument "query": expected string, got integer'),
        ({"query": "x", "limit": True}, 'argument "limit": expected integer, got boolean'),
        ({"query": "x", "limit": 2.5}, 'argument "limit": expected integer, got number'),
        ({"query": "x", "limit": 0}, 'argument "limit": 0 is below the minimum 1'),
        ({"query": "x", "limit": 99}, 'argument "limit": 99 is above the maximum 50'),
        ({"query": ""}, 'argument "query": shorter than 1 characters'),
        ({"query": "x", "mode": "slow"}, "argument \"mode\": 'slow' is not one of ['fast', 'exact']"),
        ({"query": "x", "tags": "a"}, 'argument "tags": expected array, got string'),
        ({"query": "x", "tags": ["a", 1]}, 'argument "tags[1]": expected string, got integer'),
        ({"query": "x", "tags": ["a"] * 4}, 'argument "tags": allows at most 3 items, got 4'),
        ({"query": "x", "filter": {}}, 'missing required argument "filter.year"'),
        ({"query": "x", "filter": {"year": 1, "x": 2}}, 'unknown argument "filter.x" (allowed: "year", "lang")'),
        ({"query": "x", "filter": {"year": 1, "lang": 5}}, 'argument "filter.lang": expected string or null'),
    ],
)
def test_bad_arguments_are_named_for_the_model(params, args, message):
    with pytest.raises(ToolArgumentError) as e:
        validate_arguments(params, args)
    assert message in str(e.value)


def test_all_problems_are_reported_at_once(params):
    with pytest.raises(ToolArgumentError) as e:
        validate_arguments(params, {"limit": "5", "mode": 1})
    msg = str(e.value)
    assert 'missing required argument "query"' in msg and '"limit"' in msg and '"mode"' in msg


@pytest.mark.parametrize("args", [[], "x", None, 3])
def test_non_object_arguments(params, args):
    with pytest.raises(ToolArgumentError, match="arguments must be a JSON object"):
        validate_arguments(params, args)


def test_any_of(params):
    s = OpenAIFunctionToolSchema.model_validate(
        {
            "function": {
                "name": "f",
                "parameters": {
                    "properties": {
                        "v": {"anyOf": [{"type": "integer"}, {"type": "array", "items": {"type": "integer"}}]}
                    }
                },
            }
        }
    )
    p = s.function.parameters
    assert validate_arguments(p, {"v": [1, 2]}) == {"v": [1, 2]}
    with pytest.raises(ToolArgumentError, match="matches none"):
        validate_arguments(p, {"v": "1"})
    with pytest.raises(ToolArgumentError) as e:  # the form of the right type says what is wrong
        validate_arguments(p, {"v": [1, "x"]})
    assert str(e.value) == ('argument "v": array matches none of the allowed forms '
                            '(closest: argument "v[1]": expected integer, got string)')


@pytest.mark.parametrize(
    "bad, fragment",
    [
        ({"function": {"name": "has space"}}, "must match"),
        ({"function": {"name": "f", "parameters": {"type": "array"}}}, "must have type 'object'"),
        ({"function": {"name": "f", "parameters": {"properties": {"a": {"type": "str"}}}}}, "unknown JSON Schema type"),
        ({"function": {"name": "f", "parameters": {"properties": {}, "required": ["a"]}}}, "not in 'properties'"),
        ({"type": "retrieval", "function": {"name": "f"}}, "function"),
        ({"type": "function"}, "function"),
    ],
)
def test_schema_errors(bad, fragment):
    with pytest.raises(ValidationError, match=fragment):
        OpenAIFunctionToolSchema.model_validate(bad)


FULL = {
    "function": {
        "name": "book",
        "parameters": {
            "$defs": {"Guest": {"type": "object", "properties": {"email": {"type": "string", "format": "email"},
                                                                  "plan": {"type": "string", "default": "basic"}},
                                "required": ["email"]}},
            "properties": {
                "guest": {"$ref": "#/$defs/Guest"},
                "room": {"type": "string", "pattern": "^[A-Z][0-9]{3}$"},
                "kind": {"const": "hotel"},
                "nights": {"oneOf": [{"type": "integer", "minimum": 1}, {"type": "string", "enum": ["week"]}]},
                "extras": {"allOf": [{"type": "array"}, {"maxItems": 2}], "default": []},
            },
            "required": ["guest", "room"],
        },
    }
}


def test_every_json_schema_keyword_is_checked_by_jsonschema():
    p = OpenAIFunctionToolSchema.model_validate(FULL).function.parameters
    ok = validate_arguments(p, {"guest": {"email": "a@b.org"}, "room": "B204", "kind": "hotel", "nights": 3})
    assert ok == {"guest": {"email": "a@b.org", "plan": "basic"}, "room": "B204", "kind": "hotel", "nights": 3,
                  "extras": []}  # defaults filled through the $ref as well
    for args, message in [
        ({"guest": {}, "room": "B204"}, 'missing required argument "guest.email"'),
        ({"guest": {"email": "nope"}, "room": "B204"}, "argument \"guest.email\": 'nope' is not a valid email"),
        ({"guest": {"email": "a@b.org"}, "room": "b204"}, "argument \"room\": 'b204' does not match the pattern"),
        ({"guest": {"email": "a@b.org"}, "room": "B204", "kind": "motel"},
         "argument \"kind\": 'motel' is not the allowed value 'hotel'"),
        ({"guest": {"email": "a@b.org"}, "room": "B204", "nights": 0},
         'argument "nights": integer matches none of the allowed forms (closest: 0 is below the minimum 1)'),
        ({"guest": {"email": "a@b.org"}, "room": "B204", "extras": [1, 2, 3]},
         'argument "extras": allows at most 2 items, got 3'),
    ]:
        with pytest.raises(ToolArgumentError) as e:
            validate_arguments(p, args)
        assert message in str(e.value), (args, str(e.value))


def test_a_schema_is_checked_against_its_meta_schema():
    bad = {"function": {"name": "f", "parameters": {"properties": {"a": {"type": "string", "minLength": -1}}}}}
    with pytest.raises(ValidationError, match="not a valid JSON Schema at properties/a/minLength"):
        OpenAIFunctionToolSchema.model_validate(bad)
    composed = {"function": {"name": "f", "parameters": {"allOf": [{"properties": {"a": {}}}], "required": ["a"]}}}
    assert OpenAIFunctionToolSchema.model_validate(composed).function.parameters.required == ["a"]
    boolean = OpenAIFunctionToolSchema.model_validate(  # `true` / `false` are schemas as well
        {"function": {"name": "f", "parameters": {"properties": {"any": True, "never": False}}}})
    assert boolean.to_openai()["function"]["parameters"]["properties"] == {"any": True, "never": False}
    p = boolean.function.parameters
    assert validate_arguments(p, {"any": [1]}) == {"any": [1]}
    with pytest.raises(ToolArgumentError, match='argument "never": is not allowed'):
        validate_arguments(p, {"never": 1})
