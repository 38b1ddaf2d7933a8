"""Fixtures of the viewer tests: a small real run directory (see runfactory.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from runfactory import add_advantages, step_batch, write_metrics

from verl_agent.rollout.records import write_records


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(tiny_model_path / "tokenizer.json"))


@pytest.fixture
def run_dir(tmp_path: Path, tiny_tokenizer) -> Path:
    """A run with metrics for 3 steps, trajectories of steps 1 and 2 and a validation file."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("actor_rollout_ref:\n  model:\n    path: tiny\n    tokenizer_path: null\n")
    write_metrics(run)
    for step in (1, 2):
        write_records(run / "trajectories" / f"step_{step}.jsonl", step_batch(tiny_tokenizer, step), step=step)
    # the trainer's per-token advantages: a success above its group's mean, a failure below; the infra failure
    # (left out of the loss) has none
    add_advantages(run / "trajectories" / "step_1.jsonl", {0: 0.5, 1: -0.75, 3: -0.25})
    write_records(run / "trajectories" / "val_step_2.jsonl", step_batch(tiny_tokenizer, 2), step=2)
    return run


@pytest.fixture
def broken_run(run_dir: Path) -> Path:
    """run_dir with two malformed lines inside step_1 (lines 2 and 4) and a truncated last line, and a bad metrics line."""
    path = run_dir / "trajectories" / "step_1.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    lines.insert(1, '{"uid": "broken", "reward": 1.0, "messages": [\n')  # cut short
    lines.insert(3, '{"uid": not json}\n')
    path.write_text("".join(lines) + lines[-1][: len(lines[-1]) // 2])
    with (run_dir / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "rollout/reward/mean": \n')
    return run_dir
