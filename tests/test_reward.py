"""Reward functions: loading by module or file path, both signatures, and failures that stay per-sample."""

from __future__ import annotations

import math
import textwrap

import pytest

from verl_agent.reward import RewardError, load_reward_fn

CALL = dict(data_source="math", solution_str="The answer is 4.", ground_truth="4", extra_info={"k": 1})


def write(tmp_path, body, name="rf.py"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(body))
    return p


def test_seed_signature_from_file(tmp_path):
    p = write(tmp_path, """
        def math_reward_fn(generated_text, ground_truth):
            return 1.0 if generated_text.rstrip('.').endswith(str(ground_truth)) else 0.0
    """)
    fn = load_reward_fn(f"{p}:math_reward_fn")
    assert fn.style == "seed" and fn(**CALL).score == 1.0
    assert fn(**{**CALL, "ground_truth": "5"}).score == 0.0


def test_verl_signature_dict_result_by_module_name(tmp_path, monkeypatch):
    write(tmp_path, """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return {"score": 0.5, "acc": 1, "pred": "4", "k": extra_info["k"]}
    """, name="my_scores.py")
    monkeypatch.syspath_prepend(str(tmp_path))
    res = load_reward_fn("my_scores.compute_score")(**CALL)
    assert res.score == 0.5 and res.info == {"acc": 1.0, "k": 1.0} and res.error is None


def test_verl_signature_without_extra_info(tmp_path):
    p = write(tmp_path, "def f(data_source, solution_str, ground_truth):\n    return 2\n")
    assert load_reward_fn(f"{p}:f")(**CALL).score == 2.0


def test_verl_scorer_gets_the_arguments_it_names_and_may_be_async(tmp_path):
    """verl's own gsm8k.compute_score(solution_str, ground_truth, method=..., ...) is called with what it
    names (not data_source=); an async scorer is awaited; a required parameter no scorer gets is refused."""
    p = write(tmp_path, """
        import asyncio

        def gsm8k_like(solution_str, ground_truth, method="strict", format_score=0.0, score=1.0):
            return score if solution_str.rstrip(".").endswith(ground_truth) else format_score

        async def judged(data_source, solution_str, ground_truth, **kwargs):
            await asyncio.sleep(0)
            return {"score": 0.25, "n_kwargs": len(kwargs)}

        def needs_judge(solution_str, ground_truth, judge_url):
            return 1.0
    """)
    assert load_reward_fn(f"{p}:gsm8k_like")(**CALL).score == 1.0
    res = load_reward_fn(f"{p}:judged")(**CALL)
    assert res.score == 0.25 and res.info == {"n_kwargs": 1.0} and res.error is None  # extra_info via **kwargs
    with pytest.raises(RewardError, match=r"requires \['judge_url'\].*give them defaults"):
        load_reward_fn(f"{p}:needs_judge")


@pytest.mark.parametrize(
    "body,match",
    [
        ("def f(a, b):\n    raise KeyError('boom')\n", r"raised KeyError: 'boom'"),
        ("def f(a, b):\n    return 'high'\n", r"returned 'high', not a finite number"),
        ("def f(a, b):\n    return float('nan')\n", r"not a finite number"),
        ("def f(a, b):\n    return {'acc': 1}\n", r"dict without 'score'"),
    ],
)
def test_bad_results_are_per_sample_errors(tmp_path, body, match):
    fn = load_reward_fn(f"{write(tmp_path, body)}:f")
    res = fn(**CALL)
    assert res.score == 0.0 and not math.isnan(res.score)
    assert res.error is not None and __import__("re").search(match, res.error), res.error


def test_load_errors_name_the_problem(tmp_path):
    with pytest.raises(RewardError, match="does not exist"):
        load_reward_fn(f"{tmp_path}/nope.py:f")
    with pytest.raises(RewardError, match="has no attribute 'g'"):
        load_reward_fn(f"{write(tmp_path, 'def f(a, b): return 1')}:g")
    with pytest.raises(RewardError, match="cannot load reward function 'no_such_mod_xyz.f': No module named 'no_such_mod_xyz'"):
        load_reward_fn("no_such_mod_xyz.f")
    with pytest.raises(RewardError, match="must be 'module.func'"):
        load_reward_fn("justaname")
    with pytest.raises(RewardError, match="importing .* failed: ZeroDivisionError"):
        load_reward_fn(f"{write(tmp_path, '1/0', name='broken.py')}:f")
    with pytest.raises(RewardError, match="names int 3, not a callable"):
        load_reward_fn(f"{write(tmp_path, 'X = 3', name='const.py')}:X")
    with pytest.raises(RewardError, match="expected \\(generated_text, ground_truth\\)"):
        load_reward_fn(f"{write(tmp_path, 'def f(a, b, c): return 1', name='three.py')}:f")


async def test_gsm8k_rows_are_scored_by_data_source_without_a_reward_function(tiny_model_path) -> None:
    """verl's default_compute_score for openai/gsm8k: with no reward function, the row's data_source picks
    the strict GSM8K rule; an unknown data_source keeps the tools' calc_reward (0.0 with no tools)."""
    from transformers import AutoTokenizer

    from verl_agent.config import RolloutConfig
    from verl_agent.protocol import Message, Sample
    from verl_agent.reward import default_scorer
    from verl_agent.rollout.agent_loop import AgentLoop
    from verl_agent.engine.contract import SamplingParams
    from verl_agent.engine.backends.scripted import ScriptedEngine

    assert default_scorer("openai/gsm8k") is default_scorer("openai/gsm8k") and default_scorer("mine") is None
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    engine = ScriptedEngine(tok, lambda ids, sp: "So 3 + 4 = 7.\n#### 7", eos_id=tok.convert_tokens_to_ids("<|im_end|>"))
    loop = AgentLoop(engine, tok, RolloutConfig())
    ask = [Message("user", "3 + 4?")]
    rows = [Sample(uid="a", messages=ask, ground_truth="7", data_source="openai/gsm8k"),
            Sample(uid="b", messages=ask, ground_truth="7", data_source="mine")]
    batch = await loop.run(rows, n=1, sampling=SamplingParams(max_new_tokens=32))
    assert [t.reward for t in batch.trajectories] == [1.0, 0.0]
