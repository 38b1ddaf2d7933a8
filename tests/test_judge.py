"""LLM-as-judge rewards (verl_agent/judge.py) against a real HTTP judge: a FastAPI server on loopback
(tests/judge_helpers.py; it grades by rule, since a judge model is what cannot run here) and our own
OpenAI-compatible endpoint serving the tiny model. Retries, back-off, timeouts, the concurrency limit,
the cache, and failures as infrastructure failures counted by cause, also through the agent loop and config.
"""

from __future__ import annotations

import asyncio
import pickle
import re
import socket
import time

import httpx
import pytest
from judge_helpers import RUBRIC, JudgeServer
from model_helpers import sample, scripted_engine

from verl_agent.config import ConfigError, load_config
from verl_agent.judge import DEFAULT_SCORE_PATTERN, Judge, JudgeError, check_score_pattern, parse_score
from verl_agent.reward import load_reward_fn
from verl_agent.rollout.agent_loop import AgentLoop
from verl_agent.rollout.build import build_reward
from verl_agent.engine.contract import SamplingParams


@pytest.fixture(scope="module")
def server():
    with JudgeServer() as s:
        yield s


@pytest.fixture
def judge(server):
    server.reset()
    j = Judge(server.url, "judge-model", scoring_prompt=RUBRIC, api_key="k-123", backoff=0.01, timeout=5)
    yield j
    j.close()


def test_rubric_score_and_cache(server, judge):
    assert judge.score_sync("What is 6 * 7?", "It is 42.", ground_truth=42) == 1.0
    assert judge.score_sync("What is 6 * 7?", "It is 41.", ground_truth=42) == 0.0
    first = server.requests[0]
    assert first["message"] == "Task: What is 6 * 7?\nReference: 42\nAnswer: It is 42.\nEnd with 'Score: N' (0-10)."
    assert first["model"] == "judge-model" and first["authorization"] == "Bearer k-123"
    assert first["body"]["temperature"] == 0.0 and first["body"]["max_tokens"] == 512
    # the same (prompt, response, ground truth) again: from the cache, no request
    assert judge.score_sync("What is 6 * 7?", "It is 42.", ground_truth=42) == 1.0
    assert len(server.requests) == 2 and judge.stats["cache_hits"] == 1
    # another ground truth, rubric or model is another question
    assert judge.score_sync("What is 6 * 7?", "It is 42.", ground_truth=41) == 0.0
    judge.template = RUBRIC + " Be strict."
    assert judge.score_sync("What is 6 * 7?", "It is 42.", ground_truth=42) == 1.0
    judge.model = "other-model"
    with pytest.raises(JudgeError) as e:  # the server does not serve it: 404, not retried
        judge.score_sync("What is 6 * 7?", "It is 42.", ground_truth=42)
    assert e.value.cause == "judge_unavailable" and "HTTP 404" in str(e.value)
    assert len(server.requests) == 5 and judge.stats["retries"] == 0


def test_429_and_500_are_retried_with_back_off_then_succeed(server, judge):
    assert judge.score_sync("q", "[fail:429:2] 7", ground_truth=7) == 1.0  # Retry-After: 0.01 honoured
    assert judge.score_sync("q", "[fail:503:3] 7", ground_truth=7) == 1.0  # max_retries=3: the 4th try
    assert [server.seen[m] for m in server.seen] == [3, 4] and judge.stats["retries"] == 5
    judge.max_retries = 2
    with pytest.raises(JudgeError) as e:
        judge.score_sync("q", "[fail:500:9] 7", ground_truth=7)
    assert e.value.cause == "judge_unavailable" and "failed 3 times" in str(e.value) and "HTTP 500" in str(e.value)


def test_unreachable_hung_and_unparsable_judges_are_failures_by_cause(server, judge):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    gone = Judge(f"http://127.0.0.1:{port}/v1", "judge-model", scoring_prompt=RUBRIC, max_retries=1, backoff=0.01)
    with pytest.raises(JudgeError) as e:
        gone.score_sync("q", "a")
    assert e.value.cause == "judge_unavailable" and "ConnectError" in str(e.value)
    gone.close()
    hung = Judge(server.url, "judge-model", scoring_prompt=RUBRIC, timeout=0.3, max_retries=1, backoff=0.01)
    t0 = time.monotonic()
    with pytest.raises(JudgeError) as e:
        hung.score_sync("q", "[hang]")
    assert e.value.cause == "judge_unavailable" and "ReadTimeout" in str(e.value)
    assert 0.6 <= time.monotonic() - t0 < 10 and server.seen[hung.render("q", "[hang]")] == 2
    hung.close()
    for response, why in [("[garbage]", "no score"), ("[score:11]", "outside score_range"), ("[score:-1]", "outside")]:
        with pytest.raises(JudgeError, match=why) as e:
            judge.score_sync("q", response)
        assert e.value.cause == "judge_unparsable"
    assert judge.score_sync("q", "[score:7.5]") == 0.75
    with pytest.raises(JudgeError):  # failures are not cached: asked again
        judge.score_sync("q", "[garbage]")
    assert server.seen[judge.render("q", "[garbage]")] == 2


async def test_concurrency_limit_and_identical_requests_share_one(server):
    server.reset()
    judge = Judge(server.url, "judge-model", scoring_prompt=RUBRIC, max_concurrent=3)
    t0 = time.monotonic()
    scores = await asyncio.gather(*(judge.score("q", f"[slow] {i}", ground_truth=i) for i in range(9)))
    assert scores == [1.0] * 9 and server.max_in_flight == 3
    assert 0.9 <= time.monotonic() - t0 < 10  # 9 answers of 0.3 s, 3 at a time
    server.reset()
    scores = await asyncio.gather(*(judge.score("q", "[slow] same", ground_truth="same") for _ in range(5)))
    assert scores == [1.0] * 5 and len(server.requests) == 1 and judge.stats["shared"] == 4
    judge.close()


def test_score_parsing_and_bad_settings():
    pat = check_score_pattern(DEFAULT_SCORE_PATTERN)
    assert parse_score("Score: 3\nOn reflection...\n**Score:** 7/10", pat, (0, 10)) == 0.7  # the last one counts
    assert parse_score('{"reason": "ok", "score": 4}', pat, (0, 10)) == 0.4
    assert parse_score("score = 2.5", pat, (1, 5)) == pytest.approx(0.375)
    with pytest.raises(ValueError, match=r"unknown placeholder\(s\) \{question\}"):
        Judge("http://x/v1", "m", scoring_prompt="{question} {response}")
    with pytest.raises(ValueError, match=r"must contain \{response\}"):
        Judge("http://x/v1", "m", scoring_prompt="Grade {prompt}")
    with pytest.raises(ValueError, match="capturing group"):
        Judge("http://x/v1", "m", score_pattern=r"Score: \d+")
    with pytest.raises(ValueError, match="score_range"):
        Judge("http://x/v1", "m", score_range=(5, 5))
    # literal braces (a JSON example) are left as they are
    j = Judge("http://x/v1", "m", scoring_prompt='Reply {"score": N} for {response}')
    assert j.render("p", "r") == 'Reply {"score": N} for r'
    assert pickle.loads(pickle.dumps(j)).render("p", "r") == j.render("p", "r")


async def test_a_users_compute_score_can_call_the_judge(judge):
    """The helper inside a user's scorer: its failures keep their cause (not reward_error), sync or async."""
    def mixed(data_source, solution_str, ground_truth, extra_info=None):
        exact = float(solution_str.strip() == str(ground_truth))
        return 0.5 * exact + 0.5 * judge.score_sync(extra_info["prompt"], solution_str, ground_truth)

    async def judged(data_source, solution_str, ground_truth, extra_info=None):
        return {"score": await judge.score(extra_info["prompt"], solution_str, ground_truth)}

    kw = {"data_source": "d", "ground_truth": 42, "extra_info": {"prompt": "What is 6 * 7?"}}
    fn = load_reward_fn(mixed)
    assert (await fn.acall(solution_str="42", **kw)).score == 1.0
    assert (await fn.acall(solution_str="It is 42.", **kw)).score == 0.5
    res = await load_reward_fn(judged).acall(solution_str="[garbage]", **kw)
    assert (res.cause, res.score) == ("judge_unparsable", 0.0) and "no score" in res.error
    res = await fn.acall(solution_str="[fail:400:1]", **kw)
    assert res.cause == "judge_unavailable" and "HTTP 400" in res.error


async def test_through_the_agent_loop_failures_are_infra_failures_by_cause(server, chat_tokenizer, rollout_cfg):
    server.reset()
    judge = Judge(server.url, "judge-model", scoring_prompt=RUBRIC, max_retries=0)
    replies = {"a": "It is 42.", "b": "It is 41.", "c": "[garbage]", "d": "[fail:500:1] 42"}
    engine = scripted_engine(chat_tokenizer, lambda text, k: replies[re.search(r"Q(\w)", text).group(1)])
    agent = AgentLoop(engine, chat_tokenizer, rollout_cfg, reward_fn=load_reward_fn(judge), max_prompt_length=400,
                      max_response_length=64)
    samples = [sample(f"Q{u}: what is 6 * 7?", uid=u, ground_truth=42) for u in replies]
    a, b, c, d = (await agent.run(samples, 1, SamplingParams(max_new_tokens=32))).trajectories
    assert (a.outcome, a.reward, b.outcome, b.reward) == ("ok", 1.0, "policy_failure", 0.0)
    assert (c.outcome, c.cause) == ("infra_failure", "judge_unparsable") and "no score" in c.error
    assert (d.outcome, d.cause) == ("infra_failure", "judge_unavailable") and "HTTP 500" in d.error
    # the judge saw the sample's prompt, the final answer and the ground truth
    assert any(r["message"].startswith("Task: Qa: what is 6 * 7?\nReference: 42\nAnswer: It is 42.\n")
               for r in server.requests)
    judge.close()


def test_configured_in_verls_reward_model_section(server, monkeypatch):
    server.reset()
    monkeypatch.setenv("MY_JUDGE_KEY", "secret-1")
    base = ["reward_model.enable=true", "reward_model.model.path=judge-model", f"reward_model.judge.api_base={server.url}",
            "reward_model.judge.max_concurrent=4", "reward_model.judge.score_range=[1,5]",
            "reward_model.judge.api_key_env=MY_JUDGE_KEY"]
    cfg = load_config(None, base)
    assert "secret-1" not in str(cfg.model_dump())  # the key stays out of the config and its saved copy
    fn = build_reward(cfg.data, cfg.custom_reward_function, cfg.reward_model)
    assert isinstance(fn.fn, Judge) and fn.style == "verl" and fn.is_async
    assert (fn.fn.url, fn.fn.model, fn.fn.max_concurrent) == (server.url + "/chat/completions", "judge-model", 4)
    assert fn.fn.score_range == (1.0, 5.0) and fn.fn.max_retries == 3
    res = fn(data_source="d", solution_str="[score:4]", ground_truth=1, extra_info={"prompt": "q"})
    assert res.score == 0.75 and server.requests[-1]["authorization"] == "Bearer secret-1"  # (4 - 1) / (5 - 1)
    for bad, key in [(["reward_model.enable=true", "reward_model.model.path=m"], "reward_model.judge.api_base"),
                     (["reward_model.enable=true", "reward_model.judge.api_base=http://x/v1"], "reward_model.model.path"),
                     (["reward_model.judge.max_retries=5"], "only reward_model.enable=true uses it"),
                     ([*base[:3], "data.reward_fn=m.f"], "a reward function is set too"),
                     (["reward_model.judge.scoring_prompt=Grade {question} then {response}"], "unknown placeholder(s) {question}"),
                     (["reward_model.judge.score_pattern=Score"], "capturing group"),
                     (["reward_model.judge.max_concurrent=0"], "max_concurrent")]:
        with pytest.raises(ConfigError, match=re.escape(key)):
            load_config(None, bad)


async def test_our_endpoint_serving_the_tiny_model_as_the_judge(tiny_model_path):
    """The real judge path end to end: our OpenAI-compatible endpoint, the tiny model, greedy. The tiny model
    answers "The answer is N." to some arithmetic (the score, on 0-100) and noise to others."""
    from transformers import AutoTokenizer

    from verl_agent.engine.backends.hf_engine import HFEngine
    from verl_agent.parsers import get_parser
    from verl_agent.rollout.openai.openai_server import OpenAIServer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_path))
    engine = HFEngine(str(tiny_model_path), max_num_seqs=4)
    endpoint = OpenAIServer(engine, tok, get_parser("hermes"), model_names=("tiny-judge",), max_response_length=64)
    await endpoint.start()
    sessions = [endpoint.open_session(SamplingParams(temperature=0.0, max_new_tokens=24), uid=f"j{i}") for i in (0, 1)]
    try:
        async with httpx.AsyncClient() as direct:  # the model asked directly, without the judge
            r = await direct.post(endpoint.base_url(sessions[0].sid) + "/chat/completions",
                                  headers={"Authorization": f"Bearer {sessions[0].sid}"},
                                  json={"model": "tiny-judge", "messages": [{"role": "user", "content": "Compute 3 + 5."}]})
        said = r.json()["choices"][0]["message"]["content"]
        number = int(re.search(r"answer is (\d+)", said).group(1))
        judge = Judge(endpoint.base_url(sessions[1].sid), "tiny-judge", api_key=sessions[1].sid, scoring_prompt="{response}",
                      score_pattern=r"answer is (\d+)", score_range=(0, 100), max_retries=0)
        assert await judge.score("", "Compute 3 + 5.") == number / 100
        with pytest.raises(JudgeError) as e:  # its answer to this one has no "answer is N"
            await judge.score("", "What is 2 + 3?")
        assert e.value.cause == "judge_unparsable" and "no score" in str(e.value)
        judge.close()
    finally:
        await endpoint.stop()
        await engine.close()


def test_the_documented_config_loads(tmp_path):
    """docs/training.md's reward_model example is a valid config, and its score_pattern is the default."""
    from pathlib import Path

    doc = (Path(__file__).parents[1] / "docs" / "training.md").read_text()
    block = re.search(r"```yaml\n(reward_model:\n.*?)```", doc, re.S).group(1)
    (tmp_path / "c.yaml").write_text(block)
    cfg = load_config(tmp_path / "c.yaml")
    assert cfg.reward_model.enable and cfg.reward_model.judge.score_pattern == DEFAULT_SCORE_PATTERN
    judge = build_reward(cfg.data, cfg.custom_reward_function, cfg.reward_model).fn
    assert judge.render("P", "R", 7) == "Task: P\nReference answer: 7\nResponse: R\n" \
        'Explain briefly, then end with "Score: N" (N from 0 to 10).\n'
