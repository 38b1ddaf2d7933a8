"""The built-in `calculator` tool: safe arithmetic on what the model writes.

Nothing is passed to `eval`. The expression is parsed with `ast` and only number
literals, + - * / // % ** (also written ^), parentheses, unary signs, a few math
functions (sqrt, abs, round, min, max, floor, ceil, log, exp, sin, cos, tan) and
the constants pi and e are evaluated. Sizes are bounded before computing, so
`9**9**9` or `10**10**6` is refused instead of eating the CPU.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable
from typing import Any

from verl_agent.tools.base import BaseTool, ToolResponse
from verl_agent.tools.schema import OpenAIFunctionToolSchema

__all__ = ["CalculatorTool", "CalculatorError", "evaluate", "format_number"]

MAX_EXPRESSION_CHARS = 1000
MAX_NODES = 200
MAX_INT_BITS = 4096  # ~1233 decimal digits
MAX_EXPONENT = 10_000

MAX_ROUND_DIGITS = 1000  # round(7, -10**9) would build 10**(10**9) first: a hang no tool timeout can stop


def _round(x: Any, ndigits: Any = None) -> Any:
    if ndigits is not None and isinstance(ndigits, int) and abs(ndigits) > MAX_ROUND_DIGITS:
        raise CalculatorError(f"round to at most {MAX_ROUND_DIGITS} digits")
    return round(x) if ndigits is None else round(x, ndigits)


_FUNCS: dict[str, Callable[..., Any]] = {
    "sqrt": math.sqrt, "abs": abs, "round": _round, "min": min, "max": max, "floor": math.floor,
    "ceil": math.ceil, "log": math.log, "exp": math.exp, "sin": math.sin, "cos": math.cos, "tan": math.tan,
}  # fmt: skip
_CONSTS = {"pi": math.pi, "e": math.e}
_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
}  # fmt: skip

SCHEMA = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression, e.g. '(12 + 3) * 4 / 5' or '2 ** 10'.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "The arithmetic expression to evaluate."}},
            "required": ["expression"],
        },
    },
}


class CalculatorError(ValueError):
    """The expression is not plain arithmetic, or is too large to compute."""


def _check_size(v: Any) -> Any:
    if isinstance(v, int) and v.bit_length() > MAX_INT_BITS:
        raise CalculatorError(f"result too large (over {MAX_INT_BITS} bits)")
    if isinstance(v, float) and not math.isfinite(v):
        raise CalculatorError("result is not a finite number")
    return v


def _pow(a: Any, b: Any) -> Any:
    if abs(b) > MAX_EXPONENT:
        raise CalculatorError(f"exponent {b} is larger than {MAX_EXPONENT}")
    if isinstance(a, int) and isinstance(b, int) and b > 0 and a.bit_length() * b > MAX_INT_BITS + 64:
        raise CalculatorError(f"result too large (over {MAX_INT_BITS} bits)")
    try:
        r = a**b
    except OverflowError as e:
        raise CalculatorError("result too large") from e
    if isinstance(r, complex):
        raise CalculatorError("result is a complex number")
    return r


def _mul(a: Any, b: Any) -> Any:
    if isinstance(a, int) and isinstance(b, int) and a.bit_length() + b.bit_length() > MAX_INT_BITS + 1:
        raise CalculatorError(f"result too large (over {MAX_INT_BITS} bits)")
    return a * b


def _eval(node: ast.AST) -> Any:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _check_size(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        v = _eval(node.operand)
        return -v if isinstance(node.op, ast.USub) else +v
    if isinstance(node, ast.BinOp):
        a, b = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow):
            return _check_size(_pow(a, b))
        if isinstance(node.op, ast.Mult):
            return _check_size(_mul(a, b))
        fn = _BINOPS.get(type(node.op))
        if fn is None:
            raise CalculatorError(f"operator {type(node.op).__name__} is not supported")
        return _check_size(fn(a, b))
    if isinstance(node, ast.Name) and node.id in _CONSTS:
        return _CONSTS[node.id]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS and not node.keywords:
        return _check_size(_FUNCS[node.func.id](*[_eval(a) for a in node.args]))
    if isinstance(node, ast.Call):
        fname = getattr(node.func, "id", None) or getattr(node.func, "attr", None) or type(node.func).__name__
        raise CalculatorError(f"function '{fname}' is not allowed; allowed: {', '.join(_FUNCS)}")
    what = node.id if isinstance(node, ast.Name) else type(node).__name__
    raise CalculatorError(f"'{what}' is not allowed in an arithmetic expression")


def evaluate(expression: str) -> int | float:
    """Evaluate `expression` safely; raises CalculatorError on anything but bounded arithmetic."""
    text = expression.strip().replace("^", "**").replace("×", "*").replace("÷", "/")
    if not text:
        raise CalculatorError("empty expression")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"invalid expression {expression!r}") from e
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise CalculatorError(f"expression has more than {MAX_NODES} parts")
    try:
        return _eval(tree)
    except ZeroDivisionError as e:
        raise CalculatorError("division by zero") from e
    except (TypeError, ValueError, OverflowError) as e:
        if isinstance(e, CalculatorError):
            raise
        raise CalculatorError(str(e)) from e


def format_number(v: int | float) -> str:
    """Integers (also 444.0) without a trailing '.0'; other floats to 12 significant digits."""
    if isinstance(v, float) and v.is_integer() and abs(v) < 1e15:
        return str(int(v))
    if isinstance(v, float):
        return format(v, ".12g")
    return str(v)


class CalculatorTool(BaseTool):
    """`calculator(expression)`: returns the value as text, or "Error: ..." for a bad expression."""

    def __init__(self, config: dict[str, Any] | None = None, tool_schema: OpenAIFunctionToolSchema | None = None):
        super().__init__(config, tool_schema or OpenAIFunctionToolSchema.model_validate(SCHEMA))

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict[str, Any]]:
        try:
            value = evaluate(str(parameters.get("expression", "")))
        except CalculatorError as e:
            return ToolResponse(text=f"Error: {e}"), 0.0, {"calculator_error": 1.0}
        return ToolResponse(text=format_number(value)), 0.0, {"calculator_error": 0.0}
