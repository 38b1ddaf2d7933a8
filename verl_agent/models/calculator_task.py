"""The calculator task: arithmetic questions the tiny model learns to answer with a tool.

Questions look like "What is 37 * 12 + 5?"; the assistant may call the tool
``calculator`` with ``{"expression": "37 * 12 + 5"}`` and then answers
"The answer is 449." The reward is 1.0 iff the last number of the final
answer equals the ground truth. Train and test problems never share an
expression: the split is decided by a hash of the expression.
"""

from __future__ import annotations

import ast
import hashlib
import json
import operator
import random
import re
from pathlib import Path
from typing import Any

from verl_agent.tools.calculator import SCHEMA as CALCULATOR_SCHEMA

__all__ = [
    "CALCULATOR_TOOL_SCHEMA",
    "DATA_SOURCE",
    "SYSTEM_PROMPT",
    "calculator_reward",
    "evaluate_expression",
    "format_number",
    "make_problems",
    "make_verl_rows",
    "write_calculator_data",
]

DATA_SOURCE = "calculator"
SYSTEM_PROMPT = "You are a helpful assistant. Use the calculator tool for arithmetic."
CALCULATOR_TOOL_SCHEMA: dict[str, Any] = CALCULATOR_SCHEMA  # the built-in tool's own schema

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_MAX_ABS = 1e15
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")
_SPLITS = ("train", "test")


def evaluate_expression(expression: str) -> float | int:
    """Evaluate + - * / // % ** and parentheses on numbers; anything else raises ValueError.

    Uses the AST rather than eval() so that a model's output can never run code.
    """
    if not isinstance(expression, str) or not expression.strip():
        raise ValueError("expression must be a non-empty string")
    if len(expression) > 200:
        raise ValueError(f"expression too long ({len(expression)} chars, max 200)")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from e
    return _eval_node(tree.body)


def _eval_node(node: ast.AST) -> float | int:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        v = _eval_node(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval_node(node.left), _eval_node(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent too large (max 64)")
        try:
            out = _OPS[type(node.op)](left, right)
        except ZeroDivisionError as e:
            raise ValueError("division by zero") from e
        if isinstance(out, complex) or abs(out) > _MAX_ABS:
            raise ValueError("result out of range")
        return out
    raise ValueError(f"unsupported element in expression: {ast.dump(node)[:60]}")


def format_number(x: float | int) -> str:
    """Integers without '.0'; other floats with up to 6 decimals, trailing zeros dropped."""
    if isinstance(x, float) and x.is_integer():
        x = int(x)
    if isinstance(x, int):
        return str(x)
    return f"{x:.6f}".rstrip("0").rstrip(".")


def calculator_reward(data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None) -> float:
    """1.0 iff the last number in `solution_str` equals `ground_truth` (numerically), else 0.0."""
    found = _NUMBER.findall(solution_str or "")
    if not found:
        return 0.0
    try:
        got = float(found[-1].replace(",", ""))
        want = float(str(ground_truth).replace(",", ""))
    except ValueError:
        return 0.0
    return 1.0 if abs(got - want) < 1e-6 * max(1.0, abs(want)) else 0.0


def _split_of(expression: str) -> str:
    h = int(hashlib.sha256(expression.encode()).hexdigest()[:8], 16)
    return "test" if h % 10 == 0 else "train"


_SYMBOL_FORMS = ["What is {e}?", "Calculate {e}.", "Compute {e}.", "What is {e}? Use the calculator.",
                 "Find the value of {e}.", "How much is {e}?"]
_WORD_FORMS = {"+": ["What is the sum of {a} and {b}?", "What is {a} plus {b}?"],
               "-": ["What is {a} minus {b}?", "Subtract {b} from {a}."],
               "*": ["What is the product of {a} and {b}?", "What is {a} times {b}?"]}


def _one_problem(rng: random.Random) -> tuple[str, str]:
    """(question, expression) with an integer answer."""
    n_ops = rng.choice([1, 2, 2])
    nums = [rng.randint(2, 99) for _ in range(n_ops + 1)]
    ops = [rng.choice("+-*") for _ in range(n_ops)]
    expr = str(nums[0]) + "".join(f" {o} {n}" for o, n in zip(ops, nums[1:]))
    if n_ops == 1 and rng.random() < 0.3:
        form = rng.choice(_WORD_FORMS[ops[0]])
        return form.format(a=nums[0], b=nums[1]), expr
    return rng.choice(_SYMBOL_FORMS).format(e=expr), expr


def make_problems(n: int, seed: int = 0, split: str = "train") -> list[dict[str, Any]]:
    """`n` rows {"prompt", "answer", "expression"} of one split; same seed -> same rows."""
    if split not in _SPLITS:
        raise ValueError(f"split must be one of {_SPLITS}, got {split!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(f"calculator-{seed}-{split}")
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    while len(rows) < n:
        question, expr = _one_problem(rng)
        if _split_of(expr) != split or question in seen:
            continue
        seen.add(question)
        rows.append({"prompt": question, "answer": format_number(evaluate_expression(expr)), "expression": expr})
    return rows


def make_verl_rows(rows: list[dict[str, Any]], split: str, system_prompt: str = SYSTEM_PROMPT) -> list[dict[str, Any]]:
    """The same problems in verl's row format (chat prompt, reward_model.ground_truth, data_source)."""
    return [
        {
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "system", "content": system_prompt}, {"role": "user", "content": r["prompt"]}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": r["answer"]},
            "extra_info": {"split": split, "index": i, "expression": r["expression"]},
        }
        for i, r in enumerate(rows)
    ]


def write_calculator_data(out_dir: str | Path, n_train: int = 512, n_test: int = 64, seed: int = 0,
                          fmt: str = "simple", system_prompt: str = SYSTEM_PROMPT) -> tuple[Path, Path]:
    """Write train.jsonl / test.jsonl into `out_dir` ("simple" rows or "verl" rows with `system_prompt`)."""
    if fmt not in ("simple", "verl"):
        raise ValueError(f"fmt must be 'simple' or 'verl', got {fmt!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for split, n in (("train", n_train), ("test", n_test)):
        rows = make_problems(n, seed=seed, split=split)
        if fmt == "verl":
            rows = make_verl_rows(rows, split, system_prompt)
        else:
            rows = [{"prompt": r["prompt"], "answer": r["answer"]} for r in rows]
        path = out / f"{split}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths.append(path)
    return paths[0], paths[1]
