"""A verl user's files, unchanged, through the data loader, real rollouts and one training step.

verl's tool YAMLs (GSM8K, search, Sandbox Fusion in one tools list), its interaction YAML, its GSM8K
parquet rows and a reward function with verl's signature named by verl's keys
(`custom_reward_function.path/name`). The tools talk to real servers on loopback: the example's
retrieval server (uvicorn) and `verl-agent sandbox serve --backend process`.

A scripted engine stands in for a model that uses the tools well (none can be downloaded here), so
tool texts and rewards are asserted exactly; the tiny model then trains one step on the same files
through Ray (plumbing: the aliases resolve inside the workers, nothing fails for infrastructure reasons).
"""

from __future__ import annotations

import json
import math
import os
import tempfile

import pytest
from verl_files import GSM8K_INTERACTION_YAML, GSM8K_TOOL_YAML, PROBLEMS, SANDBOX_TOOL_YAML, SEARCH_TOOL_YAML
from verl_files import VERL_REWARD_PY, gsm8k_rows, load_repo_module, solution, write, write_parquet

from verl_agent.config import load_config
from verl_agent.data import load_samples
from verl_agent.interactions.gsm8k import CORRECT, INCORRECT
from verl_agent.rollout.build import build_agent_loop, build_reward
from verl_agent.engine.contract import SamplingParams

helpers = load_repo_module("tests/examples/example_helpers.py")
TRUTH = {q: solution(a) for q, a in PROBLEMS}


@pytest.fixture(scope="module")
def sandbox():
    with helpers.SandboxProcess("process") as server:
        yield server


@pytest.fixture
def verl_files(tmp_path):
    """verl's files: parquet (tool / interaction rows), the interaction YAML, a verl-signature reward file."""
    return {
        "tool_data": write_parquet(tmp_path / "train_tool.parquet", gsm8k_rows("tool")),
        "inter_data": write_parquet(tmp_path / "train_inter.parquet", gsm8k_rows("interaction")),
        "interaction": write(tmp_path, "gsm8k_interaction_config.yaml", GSM8K_INTERACTION_YAML),
        "reward": write(tmp_path, "gsm8k_reward.py", VERL_REWARD_PY),
    }


@pytest.fixture
def verl_tools(verl_files, tmp_path, retrieval, sandbox):
    """verl_files plus one tools YAML with verl's three tool entries, pointed at the loopback servers."""
    entries = [t.split("tools:\n", 1)[1] for t in (SEARCH_TOOL_YAML, SANDBOX_TOOL_YAML)]
    text = GSM8K_TOOL_YAML + "".join(e.replace("{url}", u) + "\n" for e, u in zip(entries, (retrieval.url,
                                                                                           sandbox.url)))
    return {**verl_files, "tools": write(tmp_path, "tool_config.yaml", text)}


def verl_config(files, kind, model_path, *extra):
    """The run config a verl user writes (verl's key names), for the tool or the interaction run."""
    mt = "actor_rollout_ref.rollout.multi_turn"
    if kind == "tool":
        keys = [f"data.train_files=[{files['tool_data']}]", f"{mt}.tool_config_path={files['tools']}",
                f"custom_reward_function.path={files['reward']}", "custom_reward_function.name=compute_score"]
    else:
        keys = [f"data.train_files=[{files['inter_data']}]", f"{mt}.interaction_config_path={files['interaction']}"]
    return load_config(None, [*keys, "data.val_files=[]", "data.max_prompt_length=1024", f"{mt}.enable=true",
                              f"{mt}.max_assistant_turns=3", f"actor_rollout_ref.model.path={model_path}",
                              "trainer.device=cpu", *extra])


def test_verl_parquet_rows_load(verl_files):
    tool_rows, inter_rows = load_samples(verl_files["tool_data"]), load_samples(verl_files["inter_data"])
    assert len(tool_rows) == len(inter_rows) == len(PROBLEMS)
    s = tool_rows[2]
    assert [m.role for m in s.messages] == ["system", "user"] and s.messages[1].content.startswith("Ann had 1,500")
    assert (s.ground_truth, s.data_source) == ("1200", "openai/gsm8k")
    assert s.tools_kwargs == {"calc_gsm8k_reward": {"create_kwargs": {"ground_truth": "1200"}}}
    assert s.extra_info["index"] == 2 and s.extra_info["split"] == "train" and s.extra_info["need_tools_kwargs"]
    assert s.interaction_kwargs == {"query": s.messages[1].content, "ground_truth": "1200"}  # no name: not used
    assert inter_rows[1].interaction_kwargs == {"name": "gsm8k", "query": inter_rows[1].messages[1].content,
                                                "ground_truth": "72"}


def _question(prompt_text: str) -> str:
    """The raw GSM8K question of the (first) user message in the rendered prompt."""
    return prompt_text.split("<|im_start|>user\n", 1)[1].split(" Let's think step by step")[0]


def _tool_user(text: str, k: int) -> str:
    """Turn 0: search, run code and submit the answer in one turn; turn 1: the final answer."""
    truth = TRUTH[_question(text.split("<|im_start|>assistant")[0])]
    if k == 0:
        return "\n".join([helpers.tool_call("search", json.dumps({"query_list": ["Brask founded"]})),
                          helpers.tool_call("code_interpreter", json.dumps({"code": f"print({truth} + 0)"})),
                          helpers.tool_call("calc_gsm8k_reward", json.dumps({"answer": truth}))])
    return f"The tools agree. #### {truth}"


async def test_scripted_rollout_with_verls_tools_and_reward(verl_tools, tiny_tok, tiny_model_path):
    cfg = verl_config(verl_tools, "tool", tiny_model_path, "data.max_response_length=1024",  # search results are long
                      "actor_rollout_ref.rollout.multi_turn.max_parallel_calls=3")
    r = cfg.actor_rollout_ref.rollout
    loop = build_agent_loop(r, cfg.data, helpers.scripted_engine(tiny_tok, _tool_user), tiny_tok,
                            build_reward(cfg.data, cfg.custom_reward_function, cfg.reward_model))
    samples = load_samples(verl_tools["tool_data"])
    batch = await loop.run(samples, 1, SamplingParams(temperature=1.0, max_new_tokens=256, seed=0))
    for traj, sample in zip(batch.trajectories, samples):
        assert traj.error is None and traj.outcome == "ok", (traj.error, traj.cause)
        search, code, gsm8k = [m.content for m in traj.messages[3:6]]
        assert [m.role for m in traj.messages[2:]] == ["assistant", "tool", "tool", "tool", "assistant"]
        assert json.loads(search)["result"].startswith("Doc 1 (Title: Brask)\nBrask is a town of the Velmar Islands")
        assert code.strip() == sample.ground_truth
        assert gsm8k == f"Current parsed answer='{sample.ground_truth}' reward=1.0"
        assert traj.turns[0].num_tool_calls == 3 and traj.turns[0].score == 0.0  # an improving answer: no penalty
        assert traj.reward == 1.0  # the verl-signature compute_score of the final "#### n"


def _reflecting_student(text: str, k: int) -> str:
    truth = TRUTH[_question(text.split("<|im_start|>assistant")[0])]
    return "#### 0" if k == 0 else f"I reflected. #### {truth}"


async def test_scripted_rollout_with_verls_interaction(verl_files, tiny_tok, tiny_model_path):
    cfg = verl_config(verl_files, "interaction", tiny_model_path)
    loop = build_agent_loop(cfg.actor_rollout_ref.rollout, cfg.data,
                            helpers.scripted_engine(tiny_tok, _reflecting_student), tiny_tok, None)
    samples = load_samples(verl_files["inter_data"])
    batch = await loop.run(samples, 1, SamplingParams(temperature=1.0, max_new_tokens=64, seed=0))
    for traj in batch.trajectories:
        assert traj.error is None and traj.stop_reason == "interaction_done"
        assert [m.content for m in traj.messages[3:4]] == [INCORRECT] and traj.reward == 1.0
        assert [t.score for t in traj.turns] == [0.0, 1.0]
    assert CORRECT not in [m.content for m in batch.trajectories[0].messages]  # "done" ends without a user turn


@pytest.fixture(scope="module")
def ray_local():
    """One local Ray for the module, reused if the session already started one."""
    import ray

    started = not ray.is_initialized()
    if started:
        os.environ.setdefault("RAY_TMPDIR", os.path.join(tempfile.gettempdir(), "ray"))
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(address="local", include_dashboard=False,
                 runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false"}})
    yield
    if started:
        ray.shutdown()


SMALL = ["data.train_batch_size=2", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
         "data.max_response_length=128", "trainer.total_training_steps=1", "trainer.num_cpu_workers=1",
         "trainer.logger=[console]", "trainer.val_before_train=false", "trainer.resume_mode=disable"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["tool", "interaction"])
def test_one_training_step_on_verls_files(kind, request, ray_local, tiny_model_path, tmp_path):
    from verl_agent.trainer.loop import train

    files = request.getfixturevalue("verl_tools" if kind == "tool" else "verl_files")
    result = train(verl_config(files, kind, tiny_model_path, *SMALL,
                               f"trainer.default_local_dir={tmp_path / 'run'}"))
    step = result.history[0]
    assert result.steps == 1 and step["rollout/num_trajectories"] == 4 and step["rollout/infra_failed"] == 0.0
    assert math.isfinite(step["actor/pg_loss"])
    records = [json.loads(x) for x in (tmp_path / "run" / "trajectories" / "step_1.jsonl").read_text().splitlines()]
    assert len(records) == 4 and {r["data_source"] for r in records} == {"openai/gsm8k"}
    assert all(r["reward"] in (0.0, 1.0) and r["outcome"] != "infra_failure" for r in records)
    if kind == "tool":  # the worker built verl's three tools: their schemas are in the prompt
        assert all(f'"name": "{n}"' in r["prompt_text"] for r in records
                   for n in ("calc_gsm8k_reward", "search", "code_interpreter"))
    else:  # the worker's Gsm8kInteraction answered every reply that was not "#### <truth>"
        answered = [m["content"] for r in records for m in r["messages"][2:] if m["role"] == "user"]
        assert answered and set(answered) == {INCORRECT}
