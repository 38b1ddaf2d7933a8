"""Reading Harbor task directories: task.toml fields (tomllib), refusals with clear errors, the image hash."""

from __future__ import annotations

import pytest
from task_helpers import make_task

from verl_agent.tasks.image import _from_images, environment_hash, image_tag
from verl_agent.data.harbor import TaskError, find_tasks, load_task


def test_task_toml_fields(tmp_path):
    d = make_task(tmp_path, verifier_timeout=30.0, agent_timeout=90.0, memory_mb=768, storage_mb=300,
                  verifier_extra='user = "tester"\nenv = { MODE = "strict", LEVEL = 3 }\n')
    t = load_task(d)
    c = t.config
    assert (t.name, t.instruction) == ("count-lines", "Write the number of lines of /app/input.txt to /app/count.txt.")
    assert (c.verifier_timeout_sec, c.agent_timeout_sec, c.memory_mb, c.storage_mb, c.cpus) == (30, 90, 768, 300, 1)
    assert (c.verifier_user, c.verifier_env, c.allow_internet) == ("tester", {"MODE": "strict", "LEVEL": "3"}, False)
    assert c.metadata["difficulty"] == "easy" and c.build_timeout_sec == 300.0


def test_older_size_spellings_and_refusals(tmp_path):
    d = make_task(tmp_path)
    toml = (d / "task.toml").read_text()
    (d / "task.toml").write_text(toml.replace("memory_mb = 512", 'memory = "2G"').replace("storage_mb = 256",
                                                                                           'storage = "512M"'))
    assert (load_task(d).config.memory_mb, load_task(d).config.storage_mb) == (2048, 512)
    (d / "task.toml").write_text(toml.replace("cpus = 1", "cpus = 1\nallow_internet = true"))
    with pytest.raises(TaskError, match=r"task.toml: the task asks for internet access .* unless you allow it"):
        load_task(d)
    assert load_task(d, allow_internet=True).config.allow_internet is True
    (d / "task.toml").write_text(toml.replace("cpus = 1", "cpus = 1\ngpus = 1"))
    with pytest.raises(TaskError, match="gpus = 1: tasks that need GPUs are not supported"):
        load_task(d)
    (d / "task.toml").write_text("[verifier\n")
    with pytest.raises(TaskError, match="task.toml: invalid TOML"):
        load_task(d)
    (d / "task.toml").write_text(toml.replace("timeout_sec = 60.0", 'timeout_sec = "soon"'))
    with pytest.raises(TaskError, match=r"\[verifier\]: \[timeout_sec\] must be a positive number"):
        load_task(d)


def test_terminal_bench_yaml_and_missing_parts_are_refused(tmp_path):
    tb = tmp_path / "tb-task"
    tb.mkdir()
    (tb / "task.yaml").write_text("instruction: do it\n")
    with pytest.raises(TaskError, match=r"tb-task/task.yaml: Terminal-Bench's task.yaml layout is not read; "
                                        r"convert the task to Harbor's layout"):
        load_task(tb)
    d = make_task(tmp_path)
    (d / "tests" / "test.sh").unlink()
    with pytest.raises(TaskError, match=r"tests/test.sh: missing \(the verifier\)"):
        load_task(d)
    with pytest.raises(TaskError, match="no task directories"):
        find_tasks(d / "environment")


def test_image_tag_follows_the_environment_content(tmp_path):
    import docker

    client = docker.from_env()
    a, b = make_task(tmp_path, "a"), make_task(tmp_path, "b")
    assert environment_hash(a / "environment") == environment_hash(b / "environment")
    tag = image_tag(load_task(a), client)
    assert image_tag(load_task(b), client) == tag  # identical environments share one image
    (a / "environment" / "data.txt").write_text("x")
    assert image_tag(load_task(a), client) != tag and image_tag(load_task(a), client).startswith("verl-agent-task:")
    assert image_tag(load_task(b), client) == tag  # b keeps the image of the unchanged environment
    before = image_tag(load_task(a), client)
    (a / "tests" / "test.sh").write_text("#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n")  # not in the image
    (a / "solution" / "solve.sh").write_text("true\n")
    assert image_tag(load_task(a), client) == before
    dockerfile = "FROM debian:bookworm-slim AS build\nRUN x\nFROM build\nFROM --platform=linux/amd64 python:3.12-slim\n"
    assert _from_images(dockerfile) == ["debian:bookworm-slim", "python:3.12-slim"]


def test_image_tag_follows_the_base_image(tmp_path):
    """A rebuilt base (same name, new image id) gives its tasks a new tag, so they are rebuilt on it."""
    import docker

    client = docker.from_env()
    base = "verl-agent-test-base:image-tag"
    images = [client.images.get(name) for name in ("verl-agent-sandbox-base:bookworm", "verl-agent-sandbox-runner")]
    assert images[0].id != images[1].id
    task = load_task(make_task(tmp_path, dockerfile=f"FROM {base}\nRUN true\n"))
    try:
        absent = image_tag(task, client)
        images[0].tag(base)
        first = image_tag(task, client)
        images[1].tag(base)
        assert len({absent, first, image_tag(task, client)}) == 3
    finally:
        client.images.remove(base)
