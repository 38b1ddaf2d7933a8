"""examples/code_interpreter: Python run in the sandbox through SandboxFusionTool, reward from test cases.

The sandbox server is started the way the README says (`verl-agent sandbox serve`) on a free
loopback port: with the process backend always, and with the docker backend when Docker and the
runner image are there (required in CI). The tiny model runs the example for real (plumbing); a
scripted engine stands in for a model that codes (none can be downloaded here), so the stateful
session (a function defined in one call, used in the next) and the pass-rate reward are asserted.
"""

from __future__ import annotations

import json
import os

import pytest
from example_helpers import EXAMPLES, SandboxProcess, assert_data_reproducible, example_config, load_module, rollout
from example_helpers import scripted_engine, tool_call, tools_yaml_with_url, val_samples

NAME = "code_interpreter"


def _docker_ready() -> bool:
    from verl_agent.sandbox.backends.docker import DEFAULT_IMAGE, docker_available
    from verl_agent.sandbox.image import image_exists

    ok = docker_available() and image_exists(DEFAULT_IMAGE)
    if not ok and os.environ.get("CI") == "true":
        pytest.fail("CI=true but Docker or the sandbox runner image is missing (scripts/setup_docker.sh)")
    return ok


@pytest.fixture(scope="module", params=["process", "docker"])
def sandbox(request):
    if request.param == "docker" and not _docker_ready():
        pytest.skip("Docker or the sandbox runner image is missing")
    with SandboxProcess(request.param) as server:
        yield server


@pytest.fixture
def cfg_for(sandbox, tmp_path, monkeypatch, tiny_model_path):
    """The example's config with tools.yaml and the reward pointed at the test's sandbox."""
    monkeypatch.setenv("SANDBOX_FUSION_URL", sandbox.url)

    def make(*overrides: str, tools_yaml=None):
        tools = tools_yaml or tools_yaml_with_url(tmp_path, sandbox.url)
        return example_config(NAME, f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}", *overrides,
                              model_path=tiny_model_path)

    return make


def test_make_data_reproduces_shipped_files(tmp_path):
    assert_data_reproducible(NAME, tmp_path)


def test_reward_is_the_pass_rate(sandbox, monkeypatch):
    monkeypatch.setenv("SANDBOX_FUSION_URL", sandbox.url)
    reward = load_module(EXAMPLES / NAME / "reward.py").compute_score
    cases = json.dumps([{"fn_name": "add", "args": [1, 2], "expected": 3},
                        {"fn_name": "add", "args": [2, 2], "expected": 4}])
    assert reward("code", "```python\ndef add(a, b):\n    return a + b\n```", cases) == 1.0
    assert reward("code", "```python\ndef add(a, b):\n    return 3\n```", cases) == 0.5
    assert reward("code", "```python\ndef add(a, b):\n    return a +\n```", cases) == 0.0  # a syntax error


SOLVE = [
    tool_call("code_interpreter", json.dumps({"code": "def add(a, b):\n    return a + b"})),
    tool_call("code_interpreter", json.dumps({"code": "print(add(2, 3), add(-4, 4))"})),  # add() from the call before
    "Tested it.\n```python\ndef add(a, b):\n    return a + b\n```",
]


async def test_session_keeps_state_and_reward_runs_tests(cfg_for, tiny_tok):
    cfg = cfg_for()
    sample = val_samples(cfg, 1)[0]
    assert sample.extra_info["fn_name"] == "add"
    batch, loop = await rollout(cfg, scripted_engine(tiny_tok, SOLVE), tiny_tok, [sample])
    traj = batch.trajectories[0]
    assert traj.error is None and traj.stop_reason == "end_of_turn"
    tool_texts = [m.content for m in traj.messages if m.role == "tool"]
    assert tool_texts[0] == "(no output)" and tool_texts[1].strip() == "5 0"
    assert traj.reward == 1.0 and traj.metrics["num_tool_errors"] == 0
    assert loop.tools["code_interpreter"]._instances == {}  # released: the session was closed


async def test_without_sessions_each_call_starts_fresh(cfg_for, tiny_tok, tmp_path, sandbox):
    tools = tools_yaml_with_url(tmp_path, sandbox.url)
    tools.write_text(tools.read_text().replace("enable_session: true", "enable_session: false"))
    cfg = cfg_for(tools_yaml=tools)
    batch, _ = await rollout(cfg, scripted_engine(tiny_tok, SOLVE), tiny_tok, val_samples(cfg, 1))
    second = [m.content for m in batch.trajectories[0].messages if m.role == "tool"][1]
    assert "NameError" in second and "add" in second


async def test_tiny_model_runs_with_the_sandbox(cfg_for, sandbox, tiny_engine, tiny_tok):
    if "docker" in sandbox.cmd:
        pytest.skip("the tiny model's plumbing run is backend-independent; once is enough")
    cfg = cfg_for("data.max_response_length=96")
    batch, _ = await rollout(cfg, tiny_engine, tiny_tok, val_samples(cfg, 2), n=2)
    assert len(batch) == 4
    for traj in batch.trajectories:
        assert traj.error is None, traj.error
        assert 0.0 <= traj.reward <= 1.0 and traj.cause != "reward_error"  # reward.py reached the sandbox
