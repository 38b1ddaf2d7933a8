"""The calculator tool: values, formatting, and that it never evaluates anything but bounded arithmetic."""

import time

import pytest

from verl_agent.tools import CalculatorTool, check_tool_async
from verl_agent.tools.calculator import CalculatorError, evaluate, format_number


@pytest.mark.parametrize(
    "expr, text",
    [
        ("12 * 37", "444"),
        ("(12 + 3) * 4 / 5", "12"),
        ("7 / 2", "3.5"),
        ("1 / 3", "0.333333333333"),
        ("0.1 + 0.2", "0.3"),
        ("2 ** 10", "1024"),
        ("2^10", "1024"),
        ("-3 + +5", "2"),
        ("17 // 5", "3"),
        ("17 % 5", "2"),
        ("sqrt(16) + abs(-2)", "6"),
        ("round(2.567, 2)", "2.57"),
        ("max(3, 9, 4) - min(3, 9, 4)", "6"),
        ("2 * pi", "6.28318530718"),
        ("6 × 7 ÷ 2", "21"),
        ("  1e3 + 1 ", "1001"),
        ("2 ** -2", "0.25"),
        ("10 ** 300", "1" + "0" * 300),
    ],
)
async def test_values(expr, text):
    resp, reward, metrics = await CalculatorTool().execute("i", {"expression": expr})
    assert resp.text == text
    assert reward == 0.0 and metrics == {"calculator_error": 0.0}


@pytest.mark.parametrize(
    "expr, fragment",
    [
        ("", "empty expression"),
        ("1 +", "invalid expression"),
        ("1 / 0", "division by zero"),
        ("sqrt(-1)", "math domain error"),
        ("(-8) ** 0.5", "complex"),
        ("9 ** 9 ** 9", "exponent 387420489 is larger than"),
        ("10 ** 5000", "result too large"),
        ("2 ** 4000 * 2 ** 4000", "result too large"),
        ("10.0 ** 400", "result too large"),
        ("exp(1000)", "math range error"),
        ("__import__('os')", "function '__import__' is not allowed"),
        ("__import__('os').system('true')", "function 'system' is not allowed"),
        ("().__class__", "'Attribute' is not allowed"),
        ("x + 1", "'x' is not allowed"),
        ("[1, 2]", "'List' is not allowed"),
        ("lambda: 1", "'Lambda' is not allowed"),
        ("'a' * 3", "'Constant' is not allowed"),
        ("True + 1", "'Constant' is not allowed"),
        ("1 << 5", "operator LShift is not supported"),
        ("1" + "+1" * 600, "longer than 1000 characters"),
        ("1" + "+1" * 300, "more than 200 parts"),
        ("sqrt(x=4)", "not allowed"),
    ],
)
async def test_bad_expressions_become_error_text(expr, fragment):
    resp, _, metrics = await CalculatorTool().execute("i", {"expression": expr})
    assert resp.text.startswith("Error: ")
    assert fragment in resp.text
    assert metrics == {"calculator_error": 1.0}


def test_bounds_are_checked_before_computing():
    start = time.monotonic()
    for expr in ("10 ** 10 ** 6", "99999 ** 9999", "(2 ** 4000) ** 3", "round(7, -10 ** 9)"):
        with pytest.raises(CalculatorError):
            evaluate(expr)
    assert time.monotonic() - start < 2.0  # generous: refusing must not mean computing first


def test_format_number():
    assert format_number(444.0) == "444"
    assert format_number(-3) == "-3"
    assert format_number(1e20) == "1e+20"
    assert format_number(2.5) == "2.5"


async def test_schema_and_contract():
    tool = CalculatorTool()
    schema = tool.get_openai_tool_schema().to_openai()
    assert tool.name == "calculator"
    assert schema["function"]["parameters"]["properties"]["expression"] == {
        "type": "string",
        "description": "The arithmetic expression to evaluate.",
    }
    assert schema["function"]["parameters"]["required"] == ["expression"]
    out = await check_tool_async(tool, {"expression": "6*7"})
    assert out["response"].text == "42"
