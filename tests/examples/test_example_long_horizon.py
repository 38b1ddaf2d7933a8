"""examples/long_horizon: the corridor (a code at the start, long rooms, the code at the exit) so it cannot rot.

A scripted player that plays the corridor perfectly (the real tokenizer of the tiny model, the example's
config, interaction and data): with the history kept whole (`none`) it runs out of max_context_length
before the exit; with `drop_observations`, `truncate_middle` or `summarize` it reaches the exit in several
segments, none over the limit.
"""

from __future__ import annotations

import re

from example_helpers import (EXAMPLES, assert_data_reproducible, example_config, load_module, rollout,
                             scripted_engine, val_samples)

NAME = "long_horizon"


def test_make_data_reproduces_shipped_files(tmp_path):
    # loaded from its path: other examples (turn_credit) have a make_data module of their own
    make_data = load_module(EXAMPLES / NAME / "make_data.py")
    TEST_CODES, TRAIN_CODES = make_data.TEST_CODES, make_data.TRAIN_CODES

    assert_data_reproducible(NAME, tmp_path)
    assert not set(TEST_CODES) & set(TRAIN_CODES) and len(TEST_CODES) == 18


def player(text: str, _k: int) -> str:
    code = re.search(r"Remember the code (\d+)", text).group(1)
    return f"The code is {code}."  # the warm start's policy: every reply restates the code


async def test_only_a_context_strategy_reaches_the_exit(tiny_model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_path))
    out = {}
    for strategy in ("none", "drop_observations", "truncate_middle", "summarize"):
        cfg = example_config(NAME, f"actor_rollout_ref.rollout.multi_turn.context.strategy={strategy}")
        batch, _ = await rollout(cfg, scripted_engine(tok, player), tok, val_samples(cfg, 2))
        out[strategy] = batch.trajectories
    limit = cfg.actor_rollout_ref.rollout.multi_turn.max_context_length
    assert [(t.stop_reason, t.reward) for t in out["none"]] == [("max_context_length", 0.0)] * 2
    for strategy in ("drop_observations", "truncate_middle", "summarize"):  # each rewrites, none skips a rewrite
        segs = out[strategy]
        assert [t.reward for t in segs] == [1.0] * len(segs) and len(segs) > 4, strategy
        assert [t.stop_reason for t in segs].count("interaction_done") == 2, strategy
        assert all(len(t.prompt_ids) + len(t.response_ids) <= limit for t in segs), strategy
        assert sum(t.metrics.get("context/rewrites_skipped", 0) for t in segs) == 0, strategy
        whole = len(segs[0].prompt_ids) + max(t.metrics.get("context/total_tokens", 0) for t in segs)
        assert whole > 1.5 * limit, strategy  # the whole corridor would not fit
    summaries = [t.metrics["context/summary_turns"] for t in out["summarize"] if "context/summary_turns" in t.metrics]
    assert summaries == [len(out["summarize"]) / 2 - 1] * 2  # one summary turn per rewrite (the pair is alike)
