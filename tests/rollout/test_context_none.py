"""`context.strategy: none` is the agent loop as it was before context strategies: the same seeded tiny-model
rollout (real HFEngine, calculator tool, some trajectories ending on the response budget) gives the records
that the code before them wrote (tests/fixtures/none_strategy_records.json, made by none_records.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from none_records import records

FIXTURE = Path(__file__).parents[1] / "fixtures" / "none_strategy_records.json"


async def test_none_reproduces_the_records_of_the_loop_before_context_strategies():
    want = json.loads(FIXTURE.read_text())
    unset = await records([])
    none = await records(["actor_rollout_ref.rollout.multi_turn.context.strategy=none"])
    assert none == unset  # bit for bit: log-probs included
    assert {r["stop_reason"] for r in want} == {"end_of_turn", "response_budget"}
    assert any(len(r["turns"]) == 2 for r in want)  # a tool call and its observation
    for got, ref in zip(none, want, strict=True):
        assert got["rollout_logprobs"] == pytest.approx(ref.pop("rollout_logprobs"), abs=1e-5)
        got.pop("rollout_logprobs")
        assert got == ref
