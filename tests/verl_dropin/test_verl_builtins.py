"""The verl-equivalent built-ins behave as verl's: GSM8K scoring, Gsm8kTool, Gsm8kInteraction, retrieval search.

Expected values are worked out by hand from verl's code (verl/utils/reward_score/gsm8k.py,
verl/tools/gsm8k_tool.py, verl/interactions/gsm8k_interaction.py, verl/tools/utils/search_r1_like_utils.py).
The search tool talks over HTTP to a real uvicorn server on loopback.
"""

from __future__ import annotations

import json

import pytest
from fastapi import FastAPI, Response
from verl_files import GSM8K_TOOL_YAML, REPO, SEARCH_TOOL_YAML, RetrievalServer, write

from verl_agent.gsm8k import compute_score, extract_solution, gsm8k_score
from verl_agent.interactions import InteractionSession
from verl_agent.interactions.gsm8k import CORRECT, INCORRECT, Gsm8kInteraction
from verl_agent.protocol import ToolCall
from verl_agent.tools import ToolSession, load_tools
from verl_agent.tools.errors import ToolUnavailable
from verl_agent.tools.retrieval import RetrievalSearchTool


def test_gsm8k_extraction_and_score_follow_verl():
    assert extract_solution("so #### 1,072.", "strict") == "1072."
    assert extract_solution("#### 12 then #### $-3,000", "strict") == "12"  # '$' before the number: not a match
    assert extract_solution("#### 12 then #### -3,000", "strict") == "-3000"
    assert extract_solution("the answer is 72", "strict") is None
    assert extract_solution("I get 1,000 apples.", "flexible") == "1,000"  # the last run that is not a lone '.'
    assert extract_solution("x . y", "flexible") is None
    assert extract_solution("#### 5" + "x" * 300, "strict") is None  # only the last 300 characters count
    assert gsm8k_score("#### 72", "72") == 1.0 and gsm8k_score("#### 71", "72") == 0.0
    assert gsm8k_score("no number", "72") == 0 and gsm8k_score("#### 72", 72) == 1.0
    assert gsm8k_score("#### 71", "72", format_score=0.1) == 0.1
    assert gsm8k_score("I get 1,000", "1000", method="flexible") == 0.0  # flexible keeps the comma, as verl
    assert compute_score("openai/gsm8k", "... #### 1,200", "1200", {"split": "train"}) == 1.0


async def test_gsm8k_tool_rewards_and_texts_match_verl(tmp_path):
    tools = load_tools(write(tmp_path, "t.yaml", GSM8K_TOOL_YAML))
    kwargs = {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "72"}}}  # verl's row
    async with ToolSession(tools, kwargs, timeout=5) as s:
        seen = [await s.call(ToolCall("calc_gsm8k_reward", {"answer": a})) for a in ("70", "abc", "72", "#### 72")]
        assert [(r.text, r.reward) for r in seen] == [
            ("Current parsed answer='70' reward=0.0", -0.05),  # no improvement over 0.0: penalty
            ("Current parsed answer='abc' reward=0", -0.05),  # nothing parsed: verl prints the int 0
            ("Current parsed answer='72' reward=1.0", 0.0),
            ("Current parsed answer='#### 72' reward=1.0", -0.05),  # resubmitted, not better
        ]
        assert await s.calc_reward() == 1.0
    assert tools["calc_gsm8k_reward"]._instances == {}
    tool = tools["calc_gsm8k_reward"]
    iid = await tool.create(create_kwargs={"ground_truth": "6"})  # verl's agent loop passes create_kwargs=...
    await tool.execute(iid, {"answer": 6})
    assert await tool.calc_reward(iid) == 1.0
    async with ToolSession(tools, {}, timeout=5) as s:  # a row without the ground truth: the tool says so
        r = await s.call(ToolCall("calc_gsm8k_reward", {"answer": "1"}))
        assert not r.ok and r.infra == "tool_create_failed" and "create_kwargs.ground_truth" in r.text


async def test_gsm8k_interaction_follows_verl():
    inter = Gsm8kInteraction({"name": "gsm8k"})
    kwargs = {"name": "gsm8k", "query": "A box holds 6 pens...", "ground_truth": "1200"}
    async with InteractionSession(inter, kwargs) as s:
        assert await s.respond([{"role": "assistant", "content": "It is 1200."}]) == (False, INCORRECT, 0.0, {})
        assert await s.score() == 0.0
        done = await s.respond([{"role": "user", "content": "q"}, {"role": "assistant", "content": "So #### 1,200"}])
        assert done == (True, CORRECT, 1.0, {}) and await s.score() == 1.0
    assert inter.instances == {}
    with pytest.raises(ValueError, match="needs 'ground_truth'"):
        await inter.start_interaction("x", query="q")


async def test_search_tool_speaks_verls_retrieval_api(retrieval, tmp_path):
    tools = load_tools(write(tmp_path, "s.yaml", SEARCH_TOOL_YAML.replace("timeout: 30", "timeout: 30\n      topk: 2"),
                             retrieval.url))
    before = len(retrieval.app.state.requests)
    search_r1_row = {"search": {"create_kwargs": {"ground_truth": {"target": ["1586"]}, "question": "q",
                                                  "data_source": "searchR1_nq"}}}  # verl's Search-R1 preprocessing
    async with ToolSession(tools, search_r1_row, timeout=10) as s:
        r = await s.call(ToolCall("search", {"query_list": ["Brask founded", "Tulm known for"]}))
        bad = await s.call(ToolCall("search", {"query_list": []}))
    assert retrieval.app.state.requests[before:] == [
        {"queries": ["Brask founded", "Tulm known for"], "topk": 2, "return_scores": True}]
    assert r.ok and r.metrics == {"query_count": 2, "status": "success", "total_results": 4}
    text = json.loads(r.text)["result"]
    first, second = text.split("\n---\n")
    assert first.startswith("Doc 1 (Title: Brask)\nBrask is a town of the Velmar Islands, founded in ")
    assert "\n\nDoc 2 (Title: " in first and second.startswith("Doc 1 (Title: Tulm)\n")
    assert bad.ok and "'query_list' is missing, empty, or not a list" in json.loads(bad.text)["result"]


def _flaky_app() -> FastAPI:
    """/retrieve: 503 twice, then an answer; /broken: a body that is not verl's shape; /empty: no hits."""
    app, calls = FastAPI(), {"n": 0}

    @app.post("/retrieve")
    def retrieve(body: dict):
        calls["n"] += 1
        if calls["n"] <= 2:
            return Response(status_code=503)
        return {"result": [[{"document": {"contents": "T\nbody"}, "score": 1.0}] for _ in body["queries"]]}

    @app.post("/broken")
    def broken(body: dict):
        return {"docs": []}

    @app.post("/empty")
    def empty(body: dict):
        return {"result": [[] for _ in body["queries"]]}

    return app


async def test_search_tool_retries_5xx_and_reports_infrastructure_failures():
    with RetrievalServer(_flaky_app()) as server:
        tool = RetrievalSearchTool({"retrieval_service_url": f"{server.url}/retrieve"})
        resp, reward, metrics = await tool.execute("i", {"query_list": ["q"]})
        assert json.loads(resp.text) == {"result": "Doc 1 (Title: T)\nbody"} and metrics["status"] == "success"
        empty = RetrievalSearchTool({"retrieval_service_url": f"{server.url}/empty"})
        resp, _, metrics = await empty.execute("i", {"query_list": ["q"]})
        assert json.loads(resp.text) == {"result": "No search results found."} and metrics["status"] == "no_results"
        broken = RetrievalSearchTool({"retrieval_service_url": f"{server.url}/broken"})
        with pytest.raises(ToolUnavailable, match="not .*'result'") as err:
            await broken.execute("i", {"query_list": ["q"]})
        assert err.value.cause == "retrieval_error"
        down = RetrievalSearchTool({"retrieval_service_url": f"{server.url}/missing", "max_retries": 0})
        with pytest.raises(ToolUnavailable, match="HTTP 404"):
            await down.execute("i", {"query_list": ["q"]})
    gone = RetrievalSearchTool({"retrieval_service_url": f"{server.url}/retrieve", "max_retries": 1})
    with pytest.raises(ToolUnavailable, match="failed 2 times: ConnectError") as err:
        await gone.execute("i", {"query_list": ["q"]})
    assert err.value.cause == "retrieval_unavailable"
    with pytest.raises(ValueError, match="'retrieval_service_url' is required"):
        RetrievalSearchTool({"topk": 3})


async def test_the_search_examples_verl_config_works_against_its_server(retrieval, tmp_path):
    """examples/search_agent/tools_verl.yaml + retrieval_server.py, as its README runs them (another port)."""
    shipped = (REPO / "examples" / "search_agent" / "tools_verl.yaml").read_text()
    assert "http://127.0.0.1:8000/retrieve" in shipped
    tools = load_tools(write(tmp_path, "tools_verl.yaml", shipped.replace("http://127.0.0.1:8000", retrieval.url)))
    async with ToolSession(tools, {}, timeout=10) as s:
        r = await s.call(ToolCall("search", {"query_list": ["Which river flows through Orvik?"]}))
    assert r.ok and json.loads(r.text)["result"].startswith("Doc 1 (Title: Orvik)\nOrvik is a town")
