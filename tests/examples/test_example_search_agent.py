"""examples/search_agent: BM25 search over the shipped corpus, several searches per turn, exact-match reward.

The tiny model runs the example for real (plumbing). A scripted engine stands in for a model that
searches well (none can be downloaded here): it issues two searches in one turn, reads the
passages the retriever returned and answers, so multi-call turns and the reward are asserted.
"""

from __future__ import annotations

import json
import re

from example_helpers import EXAMPLES, assert_data_reproducible, example_config, load_module, rollout, scripted_engine
from example_helpers import tool_call, val_samples

NAME = "search_agent"


def test_make_data_reproduces_shipped_files(tmp_path):
    assert_data_reproducible(NAME, tmp_path)


def test_bm25_ranks_the_right_passage_first():
    retriever = load_module(EXAMPLES / NAME / "retriever.py")
    docs = [json.loads(x) for x in (EXAMPLES / NAME / "data" / "corpus.jsonl").read_text().splitlines()]
    index = retriever.BM25([f"{d['title']} {d['text']}" for d in docs])
    for i, d in enumerate(docs):
        if d["id"].startswith("town-"):
            assert index.search(f"{d['title']} founded", 1)[0][1] == i
    assert index.search("zzz qqq", 3) == []
    reward = load_module(EXAMPLES / NAME / "reward.py").compute_score
    assert reward("velmar", "I think <answer>The Tamm.</answer>", "Tamm") == 1.0
    assert reward("velmar", "<answer>Saar</answer>", ["Tamm", "tamm river"]) == 0.0
    assert reward("velmar", "Tamm", "Tamm") == 0.0  # no <answer> tag


async def test_tiny_model_runs_with_the_search_tool(tiny_engine, tiny_tok, tiny_model_path):
    cfg = example_config(NAME, "data.max_response_length=96", model_path=tiny_model_path)
    batch, loop = await rollout(cfg, tiny_engine, tiny_tok, val_samples(cfg, 2), n=2)
    assert len(batch) == 4 and set(loop.tools) == {"search"}
    for traj in batch.trajectories:
        assert traj.error is None, traj.error
        assert traj.reward in (0.0, 1.0) and traj.outcome != "infra_failure"  # reward.py ran


def _researcher(text: str, k: int) -> str:
    """Turn 0: search each town of a comparison question (two calls in one turn); turn 1: answer."""
    question = text.rsplit("<|im_start|>user\n", 2)[1].split("<|im_end|>")[0]
    if k == 0:
        towns = re.findall(r"first, (\w+) or (\w+)\?", question)[0]
        return "\n".join(tool_call("search", json.dumps({"query": f"{t} founded"})) for t in towns)
    found = {t: int(y) for t, y in re.findall(r"\] (\w+): \w+ is a town of the Velmar Islands, founded in (\d+)", text)}
    return f"<answer>{min(found, key=found.get)}</answer>"


async def test_two_searches_in_one_turn_then_the_right_answer(tiny_tok, tiny_model_path):
    cfg = example_config(NAME, model_path=tiny_model_path)
    samples = [s for s in val_samples(cfg, 12) if s.data_source == "velmar_compare"]
    assert samples, "the test split has comparison questions"
    batch, _ = await rollout(cfg, scripted_engine(tiny_tok, _researcher), tiny_tok, samples)
    for traj, sample in zip(batch.trajectories, samples):
        assert traj.error is None and traj.turns[0].num_tool_calls == 2 and traj.metrics["num_tool_errors"] == 0
        assert [m.role for m in traj.messages[2:]] == ["assistant", "tool", "tool", "assistant"]
        assert traj.reward == 1.0, (traj.messages[-1].content, sample.ground_truth)
