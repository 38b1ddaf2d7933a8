"""The calculator task: problems, splits, reward, safe evaluation, data files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from verl_agent.models.calculator_task import (
    CALCULATOR_TOOL_SCHEMA,
    calculator_reward,
    evaluate_expression,
    format_number,
    make_problems,
    write_calculator_data,
)


def test_problems_are_deterministic_correct_and_splits_disjoint() -> None:
    train = make_problems(400, seed=0, split="train")
    assert train == make_problems(400, seed=0, split="train")
    assert train != make_problems(400, seed=1, split="train")
    test = make_problems(100, seed=0, split="test")
    assert not {r["expression"] for r in train} & {r["expression"] for r in test}
    for r in train[:50] + test[:50]:
        assert r["answer"] == format_number(eval(r["expression"]))  # noqa: S307 - trusted, generated here
        assert set(r) == {"prompt", "answer", "expression"}
    assert any(r["prompt"] == f"What is {r['expression']}?" for r in train)
    with pytest.raises(ValueError, match="split must be one of"):
        make_problems(1, split="dev")


@pytest.mark.parametrize(
    "solution, truth, score",
    [("The answer is 449.", "449", 1.0), ("The answer is 449.", 449, 1.0), ("It is 1,234.", "1234", 1.0),
     ("448 or 449? The answer is 450.", "449", 0.0), ("The answer is -7406.", "-7406", 1.0),
     ("no number", "4", 0.0), ("", "4", 0.0), ("The answer is 2.50", "2.5", 1.0)],
)
def test_calculator_reward(solution: str, truth: object, score: float) -> None:
    assert calculator_reward("calculator", solution, truth) == score


def test_evaluate_expression_is_safe_and_formats() -> None:
    assert evaluate_expression("37 * 12 + 5") == 449
    assert format_number(evaluate_expression("7 / 2")) == "3.5"
    assert format_number(evaluate_expression("6 / 3")) == "2"
    assert format_number(evaluate_expression("-(2 + 3) * 4")) == "-20"
    for bad, msg in [("__import__('os').system('true')", "unsupported"), ("1 / 0", "division by zero"),
                     ("2 ** 1000", "exponent"), ("", "non-empty"), ("1 +", "not an arithmetic"), ("9" * 300, "too long")]:
        with pytest.raises(ValueError, match=msg):
            evaluate_expression(bad)


def test_tool_schema_shape() -> None:
    fn = CALCULATOR_TOOL_SCHEMA["function"]
    assert fn["name"] == "calculator"
    assert fn["parameters"]["required"] == ["expression"]
    assert fn["parameters"]["properties"]["expression"]["type"] == "string"


def test_write_simple_and_verl_files(tmp_path: Path) -> None:
    train, test = write_calculator_data(tmp_path / "simple", n_train=10, n_test=5, seed=0)
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    assert len(rows) == 10 and set(rows[0]) == {"prompt", "answer"}
    assert len(test.read_text().splitlines()) == 5
    train, _ = write_calculator_data(tmp_path / "verl", n_train=3, n_test=2, seed=0, fmt="verl")
    row = json.loads(train.read_text().splitlines()[0])
    assert row["data_source"] == "calculator" and row["reward_model"]["ground_truth"] == rows[0]["answer"]
    assert [m["role"] for m in row["prompt"]] == ["system", "user"] and row["prompt"][1]["content"] == rows[0]["prompt"]
    with pytest.raises(ValueError, match="fmt"):
        write_calculator_data(tmp_path, fmt="csv")
