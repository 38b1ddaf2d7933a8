"""Checkpoint files without a run: the completion marker, what a crash at each point of a save leaves, what load skips.

A save is `tmp_dir` -> (workers write) -> `finalize`. These tests write stand-in shard files and
interrupt `finalize` where a crash or a full disk would, then ask `find_latest` what a resume sees.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from verl_agent.trainer.persistence import checkpoint as ckpt
from verl_agent.trainer.loop import _restore_metrics_line
from verl_agent.trainer.tracking.tracker import Tracker


def _save(run: Path, step: int, payload: bytes = b"x" * 1000) -> Path:
    tmp = ckpt.tmp_dir(run, step)
    (tmp / "actor").mkdir()
    (tmp / "actor" / "rank0_0.bin").write_bytes(payload)
    (tmp / "extra_rank0.pt").write_bytes(payload[:10])
    return tmp


def test_finalize_writes_a_marker_listing_every_file_and_points_latest_at_it(tmp_path):
    final = ckpt.finalize(_save(tmp_path, 1), {"step": 1})
    marker = json.loads((final / ckpt.MARKER).read_text())
    assert marker == {"step": 1, "files": {"actor/rank0_0.bin": 1000, "driver_state.json": 11, "extra_rank0.pt": 10}}
    assert ckpt.verify(final) is None
    assert (tmp_path / ckpt.CKPT_DIR / ckpt.LATEST).read_text() == "1"
    assert ckpt.find_latest(tmp_path) == (final, [])


@pytest.mark.parametrize("crash_at", ["rename", "marker", "latest"])
def test_a_crash_during_finalize_leaves_the_previous_checkpoint_latest(tmp_path, monkeypatch, crash_at):
    first = ckpt.finalize(_save(tmp_path, 1), {"step": 1})
    tmp = _save(tmp_path, 2)
    real_write, real_replace, real_rename = ckpt._write_durable, os.replace, os.rename

    def boom(*args):
        raise OSError(28, "No space left on device")

    if crash_at == "marker":  # the disk fills while the marker is written
        monkeypatch.setattr(ckpt, "_write_durable", lambda p, t: boom() if p.name == ckpt.MARKER else real_write(p, t))
    elif crash_at == "rename":
        monkeypatch.setattr(os, "rename", boom)
    else:  # renamed into place, but "latest" was never updated: the complete step 2 is found anyway
        monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        ckpt.finalize(tmp, {"step": 2})
    monkeypatch.setattr(os, "replace", real_replace)
    monkeypatch.setattr(os, "rename", real_rename)
    path, skipped = ckpt.find_latest(tmp_path)
    if crash_at == "latest":
        assert path.name == "global_step_2" and ckpt.verify(path) is None
    else:
        assert path == first and skipped == []  # a .tmp directory is never a candidate
        assert (tmp_path / ckpt.CKPT_DIR / ckpt.LATEST).read_text() == "1"
        ckpt.tmp_dir(tmp_path, 2)  # the next save removes the leftover first
        assert [p.name for p in (tmp_path / ckpt.CKPT_DIR).glob("*.tmp")] == ["global_step_2.tmp"]


def test_load_skips_truncated_unmarked_and_missing_checkpoints_and_says_why(tmp_path):
    for step in (1, 2, 3, 4):
        ckpt.finalize(_save(tmp_path, step), {"step": step})
    root = tmp_path / ckpt.CKPT_DIR
    os.truncate(root / "global_step_4" / "actor" / "rank0_0.bin", 500)
    (root / "global_step_3" / ckpt.MARKER).unlink()
    (root / "global_step_2" / "extra_rank0.pt").unlink()
    path, skipped = ckpt.find_latest(tmp_path)
    assert path.name == "global_step_1"
    assert skipped == [
        "global_step_4 is not a complete checkpoint: actor/rank0_0.bin is 500 bytes, 1000 when written "
        "(truncated or overwritten)",
        "global_step_3 is not a complete checkpoint: no completion marker (complete.json): it was never finished",
        "global_step_2 is not a complete checkpoint: extra_rank0.pt is missing",
    ]
    (root / ckpt.LATEST).write_text("7")
    assert ckpt.find_latest(tmp_path)[1][0] == f"{ckpt.LATEST} names global_step_7, which does not exist"


def test_resumed_step_gets_its_metrics_line_back_when_the_driver_died_before_logging_it(tmp_path):
    tracker = Tracker(tmp_path, [])
    tracker.log(1, {"rollout/reward/mean": 0.5})
    saved = {"rollout/reward/mean": 0.25, "actor/pg_loss": -0.1}
    _restore_metrics_line(tracker, 2, saved)  # checkpoint 2 was written, its line was not
    _restore_metrics_line(tracker, 2, saved)  # already there: not written twice
    lines = [json.loads(ln) for ln in tracker.path.read_text().splitlines()]
    assert lines == [{"step": 1, "rollout/reward/mean": 0.5}, {"step": 2, **saved}]


def test_resume_survives_a_metrics_line_cut_short_and_tensorboard_forgets_the_lost_steps(tmp_path):
    """The driver died mid-append (e.g. a full disk): the half line is dropped with a warning instead of
    failing every later resume; TensorBoard's events of the steps after the checkpoint are purged."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracker = Tracker(tmp_path, ["tensorboard"])
    for step in (1, 2, 3):
        tracker.log(step, {"rollout/reward/mean": float(step)})
    tracker.close()
    with tracker.path.open("a") as f:
        f.write('{"step": 4, "rollout/reward/mean": 4.0, "time/')  # cut short
    resumed = Tracker(tmp_path, ["tensorboard"], append=True)
    resumed.truncate_after(2)  # the checkpoint was step 2
    resumed.log(3, {"rollout/reward/mean": 30.0})  # recomputed
    resumed.close()
    lines = [json.loads(ln) for ln in tracker.path.read_text().splitlines()]
    assert [(ln["step"], ln["rollout/reward/mean"]) for ln in lines] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    events = EventAccumulator(str(tmp_path / "tensorboard")).Reload().Scalars("rollout/reward/mean")
    assert [(e.step, e.value) for e in events] == [(1, 1.0), (2, 2.0), (3, 30.0)]
