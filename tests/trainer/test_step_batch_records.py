"""`StepBatch` writes the trained records on a thread of its own: `log(background=True)` returns before the
write ends, `flush` (and the next step's `keep`) waits for it, a failed write raises at `flush` (it is never
lost silently), and every other `log` returns only once written (a failure rule's stop kills the workers
without waiting). The writer is replaced by one that waits on an event: the real one is too fast to observe
the overlap."""

from __future__ import annotations

import threading
import time

import pytest

from verl_agent.trainer.policy import step_batch


def test_records_are_written_off_the_critical_path(make_cfg, monkeypatch):
    gate, written = threading.Event(), []

    def slow_write(cfg, tokenizer, trajs, name, step, advantages=None):
        gate.wait(10)
        written.append((name, len(trajs), advantages))
        if name == "bad.jsonl":
            raise OSError("disk full")

    monkeypatch.setattr(step_batch, "log_trajectories", slow_write)
    batch = step_batch.StepBatch(make_cfg(), tokenizer=None)
    assert batch.cfg.trainer.log_trajectories
    t0 = time.perf_counter()
    batch.log([object(), object()], "step_1.jsonl", 1, background=True)
    assert time.perf_counter() - t0 < 1 and written == []  # returned while the write waits
    gate.set()
    batch.keep([], 2)  # the next step begins only after the last step's records are written
    assert written == [("step_1.jsonl", 2, [None, None])]
    batch.log([object()], "bad.jsonl", 2, background=True)
    with pytest.raises(OSError, match="disk full"):
        batch.flush()
    batch.flush()  # reported once
    batch.log([object()], "step_2.jsonl", 2)  # not in the background: written when it returns
    assert written[-1] == ("step_2.jsonl", 1, [None])
