"""The viewer's data side: byte-offset index, lazy parsing, filters, tokens, metrics, live growth."""

from __future__ import annotations

import json

import pytest
from runfactory import step_batch

from verl_agent.rollout.records import write_records
from verl_agent.viewer.jsonl import JsonlIndex, RecordError
from verl_agent.viewer.query import Filter
from verl_agent.viewer.run import Run, RunError


def test_index_offsets_point_at_records_and_parse_lazily(run_dir):
    path = run_dir / "trajectories" / "step_1.jsonl"
    idx = JsonlIndex(path).refresh()
    assert len(idx) == 4 and idx.all_errors == []
    lines = path.read_bytes().split(b"\n")
    for i, e in enumerate(idx.entries):
        assert idx.raw(i) == lines[i]
        assert e.details is None  # nothing beyond the head parsed yet
    assert [e.head["outcome"] for e in idx.entries] == ["ok", "policy_failure", "infra_failure", "policy_failure"]
    assert "messages" not in idx.entries[0].head and "prompt_ids" not in idx.entries[0].head
    assert idx.details(0)["tools"] == ["calculator"] and idx.details(0)["num_turns"] == 2
    assert idx.record(0)["response_ids"] == json.loads(lines[0])["response_ids"]


def test_index_follows_a_growing_file_and_a_replaced_one(run_dir, tiny_tokenizer):
    path = run_dir / "trajectories" / "step_1.jsonl"
    idx = JsonlIndex(path).refresh()
    write_records(path, step_batch(tiny_tokenizer, 1), step=1)  # the trainer appends
    assert len(idx.refresh()) == 8 and [e.lineno for e in idx.entries] == list(range(1, 9))
    write_records(path, step_batch(tiny_tokenizer, 1), step=1, append=False)  # rewritten smaller
    assert len(idx.refresh()) == 4


def test_malformed_and_truncated_lines_are_errors_not_crashes(broken_run):
    idx = JsonlIndex(broken_run / "trajectories" / "step_1.jsonl").refresh()
    errors = {e.lineno: e.error for e in idx.all_errors}
    assert sorted(errors) == [2, 4, 7], errors
    assert "truncated record" in errors[2] and "not a JSON record" in errors[4] and "no newline" in errors[7]
    assert len(idx) == 6  # 4 good records + 2 bad lines; the unterminated tail is not an entry
    bad = next(i for i, e in enumerate(idx.entries) if e.lineno == 2)
    with pytest.raises(RecordError, match="line 2"):
        idx.record(bad)


def test_filters_by_outcome_cause_reward_tool_text_and_truncation(run_dir):
    run = Run(run_dir)

    def uids(**kw):
        res = run.query("step_1", Filter(**kw))
        return [(r["uid"], r["outcome"]) for r in res["items"]]

    assert uids(status="ok") == [("calc:1", "ok")]
    assert uids(status="infra_failure", cause="tool_timeout") == [("calc:2", "infra_failure")]
    assert uids(status="truncated") == [("calc:2", "policy_failure")]
    assert uids(min_reward=0.5) == [("calc:1", "ok")]
    assert len(uids(max_reward=0.0)) == 3
    assert uids(tool="python") == [("calc:2", "infra_failure")]
    assert uids(text="ANSWER is 401") == [("calc:1", "policy_failure")]
    assert uids(text="timeouterror") == [("calc:2", "infra_failure")]  # the error text is searchable too
    res = run.query("step_1", Filter(), offset=1, limit=2)
    assert res["matched"] == 4 and [r["index"] for r in res["items"]] == [1, 2]
    assert res["facets"]["status"] == {"ok": 1, "policy_failure": 2, "infra_failure": 1, "truncated": 1}
    assert run.tools("step_1") == {"calculator": 1, "python": 1}


def test_files_metrics_and_records_with_decoded_tokens(run_dir, tiny_tokenizer):
    run = Run(run_dir)
    assert [(f["id"], f["kind"], f["step"]) for f in run.files()] == [
        ("step_1", "train", 1), ("step_2", "train", 2), ("val_step_2", "val", 2)]
    m = run.metrics()
    assert [r["step"] for r in m["rows"]] == [1, 2, 3] and "val/success_rate" in m["keys"] and m["errors"] == []
    rec = run.record("step_1", 0)
    assert rec["response_tokens"] == [tiny_tokenizer.decode([i], skip_special_tokens=False) for i in rec["response_ids"]]
    assert "".join(rec["response_tokens"]).endswith("The answer is 444.<|im_end|>")
    assert len(rec["prompt_tokens"]) == len(rec["prompt_ids"])
    assert run.find_uid("step_2", "calc:2") == [2, 3]
    with pytest.raises(RunError, match="step_9"):
        run.record("step_9", 0)


def test_steps_count_training_steps_and_records_say_whether_they_reached_the_loss(run_dir):
    """A 3-step run logs validation at step 0 and again at step 3: 3 training steps, not 4 (or 5) rows; an
    infrastructure failure has mask-1 tokens but was never trained."""
    rows = [{"step": 0, "val/success_rate": 0.1}] + [{"step": s, "rollout/reward/mean": 0.5} for s in (1, 2, 3)] \
        + [{"step": 3, "val/success_rate": 0.4}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    m = Run(run_dir).metrics()
    assert (len(m["rows"]), m["steps"]) == (5, 3)
    recs = [Run(run_dir).record("step_1", i) for i in range(4)]
    assert [(r["outcome"], r["in_loss"]) for r in recs] == [("ok", True), ("policy_failure", True),
                                                           ("infra_failure", False), ("policy_failure", True)]
    assert sum(recs[2]["loss_mask"]) > 0  # tokens the model generated, left out of the loss all the same


def test_without_a_tokenizer_tokens_fall_back_to_ids(run_dir):
    (run_dir / "config.yaml").unlink()
    rec = Run(run_dir / "trajectories" / "step_2.jsonl").record("step_2", 0)
    assert rec["response_tokens"] is None and rec["response_ids"]


def test_metrics_errors_and_non_finite_values(broken_run):
    with (broken_run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "actor/kl": NaN, "actor/entropy": 1.0}\n')
    m = Run(broken_run).metrics()
    assert [e["line"] for e in m["errors"]] == [4]
    assert m["rows"][-1] == {"step": 5, "actor/entropy": 1.0}


def test_missing_path_is_a_run_error(tmp_path):
    with pytest.raises(RunError, match="no such file"):
        Run(tmp_path / "nope")


def test_every_budget_stop_counts_as_truncated():
    from verl_agent.viewer.query import Filter

    for stop in ("max_tokens_per_turn", "max_total_tokens", "max_context_length", "response_budget"):
        assert Filter(status="truncated").match_head({"stop_reason": stop}, None)
    assert not Filter(status="truncated").match_head({"stop_reason": "context_rewrite"}, None)
