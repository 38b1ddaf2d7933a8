"""examples/terminal_tasks: the generated Harbor suite, its oracle/nop grades in real containers, the
warm-start chats, and one GRPO step of the tiny model with the container tools.

The suite is committed; the generator must reproduce it byte for byte. One task of each family runs
through the real task runner (image built offline from the stand-in bases, a container per run, the
tests copied in after the agent): the oracle scores 1 and doing nothing scores 0.
"""

from __future__ import annotations

import asyncio
import filecmp
import json
import math
import os
import shutil
import time
import tomllib
from pathlib import Path

import pytest
from example_helpers import EXAMPLES, example_config, load_module

HERE = EXAMPLES / "terminal_tasks"
SUITE = HERE / "tasks"
FAMILIES = {"count", "find", "fixbug", "config", "rename", "transform", "fs"}


@pytest.fixture(scope="module")
def generate():
    return load_module(HERE / "generate.py")


@pytest.fixture(scope="module")
def manifest() -> dict:
    return json.loads((SUITE / "manifest.json").read_text())


def _same_tree(a: Path, b: Path) -> list[str]:
    """Files that differ (or exist on one side only) between two directory trees."""
    cmp = filecmp.dircmp(a, b)
    out = [str(Path(cmp.left) / f) for f in cmp.left_only + cmp.right_only + cmp.diff_files + cmp.funny_files]
    for sub in cmp.common_dirs:
        out += _same_tree(a / sub, b / sub)
    return out


def test_generator_reproduces_the_committed_suite(generate, manifest, tmp_path):
    m = generate.generate(tmp_path / "suite", seed=0)
    assert m == manifest
    assert not _same_tree(tmp_path / "suite", SUITE)
    for e in m["tasks"]:  # modes matter to Docker's COPY and to `bash` running the scripts
        for rel in ("tests/test.sh", "solution/solve.sh"):
            assert os.access(SUITE / e["path"] / rel, os.X_OK), f"{e['path']}/{rel} is not executable"
    other = generate.plan(seed=1)  # another seed, another suite
    assert [e["task"].instruction for e in other] != [t["instruction"] for t in m["tasks"]]


def test_suite_composition(manifest):
    tasks = manifest["tasks"]
    assert (manifest["train"], manifest["heldout"]) == (49, 21)
    assert {t["family"] for t in tasks} == FAMILIES
    for fam in FAMILIES:
        splits = [t["split"] for t in tasks if t["family"] == fam]
        assert (splits.count("train"), splits.count("heldout")) == (7, 3), fam
    assert len({t["instruction"] for t in tasks}) == len(tasks)  # no held-out task repeats a training one
    assert len({t["name"] for t in tasks}) == len(tasks)
    for t in tasks:
        d = SUITE / t["path"]
        toml = tomllib.loads((d / "task.toml").read_text())
        assert toml["environment"]["allow_internet"] is False and toml["agent"]["user"] == "agent"
        assert toml["verifier"]["timeout_sec"] > 0 and toml["environment"]["memory_mb"] == 512
        assert (d / "instruction.md").read_text().strip() == t["instruction"]
        assert (d / "environment" / "Dockerfile").read_text().startswith(f"FROM {t['base']}\n")
        assert 1 <= len(t["solution"]) <= 3 and "/logs/verifier/reward.txt" in (d / "tests/test.sh").read_text()
        shared = t["family"] == "config"  # one environment (an empty /app) for both splits
        assert t["variant"] == (0 if shared else 2) if t["split"] == "heldout" else t["variant"] in (0, 1)
    # tasks of one variant share environment/ byte for byte: one image per variant, not one per task
    envs: dict[tuple[str, int], list[Path]] = {}
    for t in tasks:
        envs.setdefault((t["family"], t["variant"]), []).append(SUITE / t["path"] / "environment")
    assert len(envs) == 6 * 3 + 1
    for key, (first, *rest) in envs.items():
        assert all(not _same_tree(first, r) for r in rest), key


def test_warm_start_chats_are_the_training_oracles(manifest):
    rows = [json.loads(line) for line in (HERE / "data" / "warm_start.jsonl").read_text().splitlines()]
    train = {f"../tasks/{t['path']}": t for t in manifest["tasks"] if t["split"] == "train"}
    assert sorted(r["task"] for r in rows) == sorted(train)
    for r in rows:
        t, msgs = train[r["task"]], r["messages"]
        assert r["reward"] == 1.0 and msgs[0] == {"role": "user", "content": t["instruction"]}
        calls = [c["function"] for m in msgs if m["role"] == "assistant" for c in m["tool_calls"]]
        assert calls == [*t["tool_calls"], {"name": "submit", "arguments": {}}]
        assert all(m["content"].endswith("[exit code 0]") for m in msgs if m.get("name") == "bash")


def _docker_ready() -> bool:
    from verl_agent.sandbox.backends.docker import docker_available
    from verl_agent.sandbox.image import BASE_IMAGE, image_exists

    ok = docker_available() and image_exists(BASE_IMAGE)
    if not ok and os.environ.get("CI") == "true":
        pytest.fail("CI=true but Docker or the sandbox base image is missing (scripts/setup_docker.sh)")
    return ok


@pytest.fixture(scope="module")
def docker_bases():
    if not _docker_ready():
        pytest.skip("Docker or the sandbox base image is missing")
    from verl_agent.tasks.bases import ensure_bases

    ensure_bases()  # cheap when present (scripts/setup_docker.sh builds them)


@pytest.mark.docker
def test_one_task_per_family_oracle_scores_1_and_nop_0(docker_bases, manifest, tmp_path):
    from verl_agent.tasks.runner import check_tasks

    picked = {}
    for t in manifest["tasks"]:  # the first held-out task of each family
        if t["split"] == "heldout":
            picked.setdefault(t["family"], t)
    for t in picked.values():
        shutil.copytree(SUITE / t["path"], tmp_path / t["name"], symlinks=True)
    results = asyncio.run(check_tasks(tmp_path, jobs=4))
    grades = {Path(d).name: (o.reward, n.reward, o.outcome, n.outcome) for d, o, n in results}
    assert grades == {t["name"]: (1.0, 0.0, "ok", "ok") for t in picked.values()}


def _task_containers(client) -> set[str]:
    return {c.id for c in client.containers.list(all=True, filters={"label": "verl-agent.tasks"})}


@pytest.mark.docker
@pytest.mark.slow
def test_tiny_model_trains_one_step_on_the_suite(docker_bases, tiny_model_path, tmp_path):
    """The example's config on CPU with the tiny model (prompt budget raised: its small vocabulary spends
    more tokens on the three tool schemas than SmolLM2's): two tasks x two samples, graded, one GRPO update."""
    import docker

    from verl_agent.trainer.loop import train

    client = docker.from_env()
    before = _task_containers(client)
    val = tmp_path / "val"
    shutil.copytree(SUITE / "heldout" / "fs-07", val / "fs-07")
    cfg = example_config(
        "terminal_tasks", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "data.max_response_length=64",
        "data.max_prompt_length=1536", "actor_rollout_ref.rollout.max_model_len=1792",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2", "actor_rollout_ref.rollout.val_kwargs.n=1",
        f"data.val_files=[{val}]", "trainer.total_training_steps=1", "trainer.num_cpu_workers=1",
        "trainer.n_gpus_per_node=0", "trainer.logger=[console]", "trainer.val_before_train=false",
        f"trainer.default_local_dir={tmp_path / 'run'}", model_path=tiny_model_path)
    result = train(cfg)
    step = result.history[0]
    assert result.steps == 1 and step["rollout/num_trajectories"] == 4 and step["rollout/infra_failed"] == 0.0
    assert math.isfinite(step["actor/pg_loss"]) and result.val_after["val/num_trajectories"] == 1
    deadline = time.monotonic() + 30  # removals may still be in flight when train() returns
    while (left := _task_containers(client) - before) and time.monotonic() < deadline:
        time.sleep(1)
    assert not left, f"{len(left)} task containers of this run were left behind after train() returned"
