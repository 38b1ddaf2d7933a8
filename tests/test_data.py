"""Datasets: both row formats, JSONL and parquet, streaming, bad rows, resumable batches."""

from __future__ import annotations

import json
import tracemalloc

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from verl_agent.data import DataError, StreamingDataset, iter_samples, load_samples

VERL_ROW = {
    "data_source": "gsm8k",
    "agent_name": "tool_agent",
    "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}],
    "reward_model": {"style": "rule", "ground_truth": "5"},
    "extra_info": {
        "index": 7,
        "tools_kwargs": {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "5"}}},
        "interaction_kwargs": {"name": "gsm8k", "query": "What is 2+3?", "ground_truth": "5"},
    },
}


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_simple_and_verl_rows(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "2+2=?", "answer": "4"}, VERL_ROW])
    simple, verl = load_samples(f)
    assert [m.to_chat() for m in simple.messages] == [{"role": "user", "content": "2+2=?"}]
    assert simple.ground_truth == "4" and simple.uid == f"{f}:1" and simple.data_source == "default"
    assert [m.role for m in verl.messages] == ["system", "user"]
    assert verl.ground_truth == "5" and verl.data_source == "gsm8k" and verl.agent_name == "tool_agent"
    assert verl.tools_kwargs["calc_gsm8k_reward"]["create_kwargs"] == {"ground_truth": "5"}
    assert verl.interaction_kwargs["name"] == "gsm8k"
    assert verl.extra_info["index"] == 7


def test_parquet_with_nested_columns(tmp_path):
    f = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist([VERL_ROW, VERL_ROW]), f)
    samples = load_samples(f)
    assert len(samples) == 2 and samples[1].uid == f"{f}:2"
    assert samples[0].tools_kwargs["calc_gsm8k_reward"]["create_kwargs"]["ground_truth"] == "5"


@pytest.mark.parametrize(
    "row,match",
    [
        ("{not json", r":2: not valid JSON"),
        ({"answer": "4"}, r":2: missing 'prompt'"),
        ({"prompt": ""}, r":2: 'prompt' is empty"),
        ({"prompt": [{"role": "wizard", "content": "x"}]}, r":2: prompt\[0\]: 'role' must be one of"),
        ({"prompt": "x", "extra_info": {"tools_kwargs": [1]}}, r":2: 'extra_info.tools_kwargs' must be an object"),
        ([1, 2], r":2: a row must be a JSON object"),
    ],
)
def test_bad_row_names_file_and_line(tmp_path, row, match):
    f = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "ok", "answer": 1}, row])
    with pytest.raises(DataError, match=match):
        load_samples(f)


def test_skip_bad_rows_counts_and_reports(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": 1}, "{oops", {"x": 1}, {"prompt": "b", "answer": 2}])
    ds = StreamingDataset([f], shuffle=False, skip_bad_rows=True)
    batch = next(ds.batches(2))
    assert [s.messages[0].content for s in batch] == ["a", "b"]
    assert ds.skipped == 2 and "d.jsonl:2" in ds.skip_reasons[0] and "d.jsonl:3" in ds.skip_reasons[1]


def test_unsupported_and_missing_files(tmp_path):
    with pytest.raises(DataError, match="unsupported dataset format"):
        list(iter_samples(write_jsonl(tmp_path / "d.csv", ["a,b"])))
    with pytest.raises(DataError, match="does not exist"):
        list(iter_samples(tmp_path / "nope.jsonl"))
    with pytest.raises(DataError, match="no dataset files"):
        StreamingDataset([])


def test_streaming_does_not_load_the_file(tmp_path):
    """A ~60 MB file: taking the first batch must cost far less memory than the file."""
    f = tmp_path / "big.jsonl"
    line = json.dumps({"prompt": "x" * 500, "answer": "1"}) + "\n"
    with f.open("w") as out:
        for _ in range(120_000):
            out.write(line)
    assert f.stat().st_size > 60e6
    tracemalloc.start()
    ds = StreamingDataset([f], shuffle=True, shuffle_buffer=1000)
    batch = next(ds.batches(8))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(batch) == 8 and peak < 10e6, peak


def test_batches_resume_exactly_and_roll_over_epochs(tmp_path):
    f = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"q{i}", "answer": i} for i in range(10)])
    ds = StreamingDataset([f], seed=3)
    it = ds.batches(4)
    first = [[s.ground_truth for s in next(it)] for _ in range(3)]  # 12 samples: crosses into epoch 1
    assert sorted(first[0] + first[1] + first[2][:2]) == list(range(10))
    state = ds.state_dict()
    rest = [[s.ground_truth for s in next(it)] for _ in range(3)]
    resumed = StreamingDataset([f], seed=0)
    resumed.load_state_dict(state)
    it2 = resumed.batches(4)
    assert [[s.ground_truth for s in next(it2)] for _ in range(3)] == rest
    assert first[:2] != [list(range(4)), list(range(4, 8))]  # actually shuffled


def test_a_row_in_two_epochs_is_two_samples(tmp_path):
    """10 rows in batches of 4: the batch spanning epochs 0 and 1 may hold one row twice; the copies must not
    share a uid (GRPO would merge their groups), and every uid in any batch is distinct."""
    f = write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"q{i}", "answer": i} for i in range(10)])
    for seed in range(20):
        it = StreamingDataset([f], seed=seed).batches(4)
        batches = [next(it) for _ in range(5)]  # 20 samples: epochs 0 and 1
        assert all(len({s.uid for s in b}) == 4 for b in batches)
        uids = [s.uid for b in batches for s in b]
        assert sum(u.endswith("@epoch1") for u in uids) == 10 and len(set(uids)) == 20


def test_need_tools_kwargs_without_tools_kwargs_is_warned_about(tmp_path, caplog):
    """verl's check: the row says it needs tools_kwargs but has none (a warning, as in verl)."""
    row = {"prompt": "x", "extra_info": {"need_tools_kwargs": True, "index": 3}}
    f = write_jsonl(tmp_path / "d.jsonl", [row, {**row, "extra_info": {**row["extra_info"], "tools_kwargs": {
        "t": {"create_kwargs": {"a": 1}}}}}])
    with caplog.at_level("WARNING", logger="verl_agent.data"):
        assert len(load_samples(f)) == 2
    assert [r.getMessage() for r in caplog.records] == [
        f"{f}:1: extra_info.need_tools_kwargs is true but extra_info.tools_kwargs is empty"]
