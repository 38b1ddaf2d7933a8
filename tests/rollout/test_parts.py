"""Small pure parts of the rollout package, with expected values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch
from model_helpers import sample, scripted_engine

from verl_agent.protocol import RolloutBatch, Trajectory, Turn
from verl_agent.rollout.agent_loop import AgentLoop
from verl_agent.engine.contract import SamplingParams
from verl_agent.rollout.metrics import summarize
from verl_agent.rollout.observations import truncate
from verl_agent.rollout.records import read_records, write_records
from verl_agent.engine.sampling import RowParams, filter_top_k_top_p, sample as sample_tokens


def test_filter_top_k_top_p_by_hand():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]] * 3))
    out = filter_top_k_top_p(logits, torch.tensor([2, 0, 0]), torch.tensor([1.0, 0.7, 0.81]))
    kept = torch.isfinite(out).tolist()
    assert kept[0] == [True, True, False, False]  # top-2
    assert kept[1] == [True, True, False, False]  # mass above token 3 is 0.8 >= 0.7: nucleus {0, 1}
    assert kept[2] == [True, True, True, False]  # 0.8 < 0.81 keeps token 2; 0.95 drops token 3
    assert out[0, 0] == logits[0, 0]


def test_sampled_logprobs_are_before_filtering():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    rows = RowParams.build([SamplingParams(temperature=1.0, top_k=1)], torch.device("cpu"))
    tok, lp = sample_tokens(logits, rows, torch.Generator().manual_seed(0))
    assert tok.item() == 0 and lp.item() == pytest.approx(math.log(0.5))
    rows = RowParams.build([SamplingParams(temperature=0.5, top_k=1)], torch.device("cpu"))
    _, lp = sample_tokens(logits, rows, None)
    assert lp.item() == pytest.approx(math.log(0.25 / (0.25 + 0.09 + 0.0225 + 0.0025)))  # softmax(logits / 0.5)


def test_sampling_draws_each_token_with_its_probability():
    """CDF inversion at one uniform number per row: frequencies match the (filtered) distribution, a token of
    probability 0 never comes, and a seeded row samples the same tokens whatever rows surround it."""
    probs = torch.tensor([0.5, 0.0, 0.3, 0.15, 0.05, 0.0])
    logits = probs.clamp(min=1e-30).log().masked_fill(probs == 0, float("-inf")).expand(4000, -1)
    rows = RowParams.build([SamplingParams(temperature=1.0)] * 4000, torch.device("cpu"))
    tok, _ = sample_tokens(logits, rows, torch.Generator().manual_seed(0))
    freq = torch.bincount(tok, minlength=6).float() / 4000
    assert freq[1] == 0 and freq[5] == 0
    assert torch.allclose(freq, probs, atol=0.03), freq  # 4000 draws: standard error <= 0.008
    top2 = RowParams.build([SamplingParams(temperature=1.0, top_k=2)] * 4000, torch.device("cpu"))
    tok, _ = sample_tokens(logits, top2, torch.Generator().manual_seed(0))
    assert set(tok.tolist()) == {0, 2} and abs(float((tok == 0).float().mean()) - 0.5 / 0.8) < 0.03

    def seeded_run(others: int) -> list[int]:
        params = [SamplingParams(temperature=1.0, seed=7)] + [SamplingParams(temperature=0.7)] * others
        rows = RowParams.build(params, torch.device("cpu"))
        return [int(sample_tokens(logits[: len(params)], rows, torch.Generator().manual_seed(others))[0][0])
                for _ in range(40)]

    assert seeded_run(0) == seeded_run(5) == seeded_run(31)
    assert len(set(seeded_run(0))) > 1  # a sequence of draws, not one number


def test_the_two_level_cdf_inversion_picks_what_one_long_cumulative_sum_picks():
    """invert_cdf (blocks of tokens, then the tokens of one block) against a float64 inversion over the whole
    row, on a vocabulary that is not a multiple of the block: the same token for 4000 uniform numbers, and
    never a token of mass 0 (a whole zero block, and zeros on block edges, among them the last token)."""
    from verl_agent.engine.sampling import CDF_BLOCK, invert_cdf

    gen = torch.Generator().manual_seed(3)
    v = 5 * CDF_BLOCK + 37
    probs = torch.rand(8, v, generator=gen) ** 4
    probs[:, CDF_BLOCK : 2 * CDF_BLOCK] = 0  # a whole block of mass 0
    probs[:, [CDF_BLOCK - 1, 2 * CDF_BLOCK, 3 * CDF_BLOCK - 1, v - 1]] = 0
    probs[1] = 0
    probs[1, 300] = 0.5  # one token holds all the mass
    u = torch.rand(500, 8, generator=gen)
    u[0] = 0.0
    ours = torch.stack([invert_cdf(probs, row) for row in u])
    cdf = probs.double().cumsum(-1)
    ref = torch.stack([torch.searchsorted(cdf, (row.double()[:, None] * cdf[:, -1:]).contiguous(), right=True)
                       .squeeze(-1) for row in u])  # fmt: skip
    assert torch.equal(ours, ref)
    assert (probs.gather(1, ours.T) > 0).all() and (ours[:, 1] == 300).all()


TEXT = "abcdefghijklmnopqrstuvwxyz" + "0123456789" * 3
MARK = "...(truncated)..."


@pytest.mark.parametrize(
    ("side", "expected"),
    [("left", MARK + TEXT[-23:]), ("right", TEXT[:23] + MARK), ("middle", TEXT[:11] + MARK + TEXT[-12:])],
)
def test_truncate(side, expected):
    assert truncate(TEXT, 40, side) == expected and len(expected) == 40
    assert truncate(TEXT, 100, side) == TEXT
    assert len(truncate(TEXT, 10, side)) == 10  # too short for the marker: plain cut
    with pytest.raises(ValueError, match="truncate_side"):
        truncate(TEXT, 5, "top")


def _traj(reward, stop, n_resp, calls=0.0, errors=0.0):
    t = Trajectory("u", [1, 2], [3] * n_resp, [1] * n_resp, [-0.1] * n_resp, reward=reward, stop_reason=stop)
    t.turns = [Turn(0, n_resp, n_resp)]
    t.metrics = {"num_tool_calls": calls, "num_tool_errors": errors}
    return t


def test_summarize_by_hand():
    m = summarize(RolloutBatch([_traj(1.0, "end_of_turn", 4, 2, 1), _traj(0.0, "response_budget", 8, 2, 0)]))
    assert m["rollout/success_rate"] == 0.5
    assert m["rollout/reward/mean"] == 0.5 and m["rollout/reward/std"] == 0.5
    assert m["rollout/response_length/mean"] == 6.0 and m["rollout/tool_calls_total"] == 4
    assert m["rollout/tool_errors_per_call"] == 0.25
    assert m["rollout/stop/end_of_turn"] == m["rollout/stop/response_budget"] == 0.5
    assert summarize(RolloutBatch([])) == {"rollout/num_trajectories": 0.0}


def test_records_round_trip(tmp_path):
    batch = RolloutBatch([_traj(1.0, "end_of_turn", 3)])
    path = write_records(tmp_path / "t.jsonl", batch, step=7)
    write_records(path, batch, step=8)
    recs = list(read_records(path))
    assert [r["step"] for r in recs] == [7, 8]
    assert recs[0]["response_ids"] == [3, 3, 3] and recs[0]["loss_mask"] == [1, 1, 1]
    assert recs[0]["turns"][0]["gen_end"] == 3
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        list(read_records(tmp_path / "bad.jsonl"))


async def test_engine_length_vs_response_budget(chat_tokenizer, rollout_cfg):
    tok = chat_tokenizer
    engine = scripted_engine(tok, ["a long answer that goes on and on and on"])
    lp = AgentLoop(engine, tok, rollout_cfg, max_prompt_length=200, max_response_length=100)
    traj = (await lp.run([sample()], 1, SamplingParams(max_new_tokens=4))).trajectories[0]
    assert traj.stop_reason == "engine_length" and len(traj.response_ids) == 4
    lp = AgentLoop(engine, tok, rollout_cfg, max_prompt_length=200, max_response_length=4)
    traj = (await lp.run([sample()], 1, SamplingParams(max_new_tokens=50))).trajectories[0]
    assert traj.stop_reason == "response_budget" and len(traj.response_ids) == 4


async def test_seeded_groups_get_distinct_seeds(chat_tokenizer, rollout_cfg):
    seen = []

    def reply(text, k):
        return "ok"

    engine = scripted_engine(chat_tokenizer, reply)
    orig = engine.generate

    async def spy(ids, sp):
        seen.append(sp.seed)
        return await orig(ids, sp)

    engine.generate = spy
    lp = AgentLoop(engine, chat_tokenizer, rollout_cfg, max_prompt_length=200, max_response_length=50)
    await lp.run([sample(uid="a"), sample(uid="b")], 2, SamplingParams(seed=10))
    assert sorted(seen) == [10, 11, 12, 13]


def test_sglang_server_args_carry_the_rollout_settings(rollout_cfg):
    """gpu_memory_utilization, rollout.dtype, enable_torch_compile and enable_prefix_caching become SGLang flags;
    sglang.extra_args win."""
    from verl_agent.rollout.build import sglang_server_args

    assert sglang_server_args(rollout_cfg) == ["--mem-fraction-static", "0.5"]
    cfg = rollout_cfg.model_copy(update={"enable_torch_compile": True, "gpu_memory_utilization": 0.7})
    assert sglang_server_args(cfg) == ["--mem-fraction-static", "0.7", "--enable-torch-compile"]
    mine = cfg.model_copy(update={"sglang": cfg.sglang.model_copy(
        update={"extra_args": ["--mem-fraction-static", "0.3", "--enable-torch-compile"]})})
    assert sglang_server_args(mine) == ["--mem-fraction-static", "0.3", "--enable-torch-compile"]
    typed = cfg.model_copy(update={"dtype": "bfloat16", "sglang": cfg.sglang.model_copy(
        update={"extra_args": ["--mem-fraction-static=0.8"]})})  # the "=" spelling counts as given too
    assert sglang_server_args(typed) == ["--mem-fraction-static=0.8", "--dtype", "bfloat16", "--enable-torch-compile"]
    uncached = rollout_cfg.model_copy(update={"enable_prefix_caching": False})
    assert sglang_server_args(uncached) == ["--mem-fraction-static", "0.5", "--disable-radix-cache"]


def test_summarize_counts_scored_trajectories_only():
    """85 scored episodes (6 successes, mean reward 0.721 worked out below) and 43 judge failures: the failures'
    placeholder 0.0 must not pull the reward and success curves down; they keep their own counts by cause."""
    scored = [_traj(1.0, "end_of_turn", 4) for _ in range(6)] + [_traj(0.7, "end_of_turn", 10) for _ in range(79)]
    for t in scored[6:]:
        t.outcome, t.cause = "policy_failure", "wrong_answer"
    failed = [_traj(0.0, "error", 2) for _ in range(43)]
    for i, t in enumerate(failed):
        t.outcome, t.cause = "infra_failure", "judge_unparsable" if i < 30 else "judge_unavailable"
    m = summarize(scored + failed)
    assert m["rollout/num_episodes"] == 128 and m["rollout/num_scored"] == 85
    assert m["rollout/reward/mean"] == pytest.approx((6 * 1.0 + 79 * 0.7) / 85)  # 0.7212, not 0.479 over 128
    assert m["rollout/reward/min"] == 0.7
    assert m["rollout/success_rate"] == pytest.approx(6 / 85)
    assert m["rollout/infra_failed"] == pytest.approx(43 / 128)
    assert m["rollout/infra_failed/judge_unparsable"] == 30 and m["rollout/infra_failed/judge_unavailable"] == 13
    assert m["rollout/response_length/mean"] == pytest.approx((6 * 4 + 79 * 10) / 85)  # as trained
    assert m["rollout/stop/error"] == pytest.approx(43 / 128)  # stop shares and totals count every trajectory
    only_failed = summarize(failed)
    assert only_failed["rollout/num_scored"] == 0
    assert "rollout/success_rate" not in only_failed and "rollout/reward/mean" not in only_failed
