"""Write data/train.jsonl and data/test.jsonl: small Python functions with test cases.

    python examples/code_interpreter/make_data.py

Each task names a function and gives test cases in the sandbox reward's format
(reward_model.ground_truth, as a JSON string like verl's code datasets). The model
may try code in the sandbox as often as it likes before it answers.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SYSTEM = ("Solve the task in Python. You can run code with the code_interpreter tool; variables you define stay "
          "available in later calls. When done, reply with the final function in one ```python block.")

# (function name, task, [(args, expected), ...])
TASKS = [
    ("add", "returns the sum of two numbers a and b", [([1, 2], 3), ([-4, 4], 0), ([10, 5], 15)]),
    ("is_even", "returns True if the integer n is even, else False", [([2], True), ([7], False), ([0], True)]),
    ("reverse", "returns the string s reversed", [(["abc"], "cba"), ([""], ""), (["ab a"], "a ba")]),
    ("fact", "returns n! for a non-negative integer n", [([0], 1), ([5], 120), ([10], 3628800)]),
    ("count_vowels", "returns how many of the letters a, e, i, o, u (any case) are in s",
     [(["Hello"], 2), (["sky"], 0), (["AEIOU"], 5)]),
    ("maximum", "returns the largest number of a non-empty list xs without using max()",
     [([[3, 9, 2]], 9), ([[-5, -2]], -2), ([[7]], 7)]),
    ("fib", "returns the n-th Fibonacci number with fib(0) = 0 and fib(1) = 1", [([0], 0), ([1], 1), ([10], 55)]),
    ("is_palindrome", "returns True if s reads the same backwards, ignoring case",
     [(["Anna"], True), (["abc"], False), ([""], True)]),
    ("digit_sum", "returns the sum of the decimal digits of the non-negative integer n",
     [([0], 0), ([123], 6), ([9999], 36)]),
    ("unique", "returns the items of xs without duplicates, in order of first appearance",
     [([[1, 2, 1, 3]], [1, 2, 3]), ([[]], []), ([["a", "a"]], ["a"])]),
    ("gcd", "returns the greatest common divisor of two positive integers a and b",
     [([12, 18], 6), ([7, 5], 1), ([9, 3], 3)]),
    ("word_count", "returns the number of words (separated by whitespace) in s",
     [(["a b  c"], 3), ([""], 0), (["one"], 1)]),
    ("squares", "returns the list of squares of 1..n", [([3], [1, 4, 9]), ([0], []), ([1], [1])]),
    ("clamp", "returns x limited to the range [lo, hi]", [([5, 0, 3], 3), ([-1, 0, 3], 0), ([2, 0, 3], 2)]),
    ("capitalize_words", "returns s with the first letter of every word upper-cased",
     [(["hello world"], "Hello World"), (["a"], "A"), ([""], "")]),
    ("second_largest", "returns the second largest distinct number in xs (it has at least two)",
     [([[1, 5, 3]], 3), ([[4, 4, 2]], 2), ([[-1, -2]], -2)]),
]


def row(name: str, task: str, cases: list, split: str, i: int) -> dict:
    tests = [{"fn_name": name, "args": args, "expected": expected} for args, expected in cases]
    return {"data_source": "code_functions",
            "prompt": [{"role": "system", "content": SYSTEM},
                       {"role": "user", "content": f"Write a Python function `{name}` that {task}."}],
            "reward_model": {"style": "sandbox", "ground_truth": json.dumps(tests)},
            "extra_info": {"split": split, "index": i, "fn_name": name}}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "data"))
    ap.add_argument("--n-test", type=int, default=4)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    splits = {"test": TASKS[: args.n_test], "train": TASKS[args.n_test :]}
    for split, tasks in splits.items():
        (out / f"{split}.jsonl").write_text("".join(json.dumps(row(*t, split, i)) + "\n" for i, t in enumerate(tasks)))


if __name__ == "__main__":
    main()
