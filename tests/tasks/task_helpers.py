"""Helpers for tests/tasks: a task written to Harbor's documented layout (standing in for `harbor tasks
init`, which needs Python >= 3.12 and does not install here), built FROM the local sandbox base image."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

BASE_IMAGE = "verl-agent-sandbox-base:bookworm"

TASK_TOML = """\
version = "1.0"

[metadata]
author_name = "verl-agent tests"
difficulty = "easy"
category = "file-operations"
tags = ["count"]

[verifier]
timeout_sec = {verifier_timeout}
{verifier_extra}
[agent]
timeout_sec = {agent_timeout}

[environment]
build_timeout_sec = 300.0
cpus = 1
memory_mb = {memory_mb}
storage_mb = {storage_mb}
"""

DOCKERFILE = f"""\
FROM {BASE_IMAGE}
USER root
RUN mkdir -p /app && printf 'hello\\nworld\\n' > /app/input.txt && chown -R 10001:10001 /app
WORKDIR /app
USER 10001
"""

# The same world on the slim Python base: small enough to export for the bwrap runtime in a test
SLIM_DOCKERFILE = DOCKERFILE.replace(f"FROM {BASE_IMAGE}", "FROM python:3.12-slim")

TEST_SH = """\
#!/bin/bash
# Harbor's convention: the verifier writes its reward to /logs/verifier/reward.txt
if [ "$(cat /app/count.txt 2>/dev/null)" = "2" ]; then echo 1 > /logs/verifier/reward.txt
else echo 0 > /logs/verifier/reward.txt; fi
"""


def make_task(root: Path, name: str = "count-lines", *, dockerfile: str = DOCKERFILE, test_sh: str = TEST_SH,
              solve: str = "#!/bin/bash\nwc -l < /app/input.txt > /app/count.txt\n",
              instruction: str = "Write the number of lines of /app/input.txt to /app/count.txt.",
              verifier_timeout: float = 60.0, agent_timeout: float = 120.0, memory_mb: int = 512,
              storage_mb: int = 256, verifier_extra: str = "", tests: dict[str, str] | None = None) -> Path:
    """A task directory in Harbor's layout (instruction.md, task.toml, environment/Dockerfile,
    tests/test.sh, solution/solve.sh)."""
    d = root / name
    (d / "environment").mkdir(parents=True)
    (d / "tests").mkdir()
    (d / "solution").mkdir()
    (d / "instruction.md").write_text(instruction + "\n")
    (d / "task.toml").write_text(TASK_TOML.format(verifier_timeout=verifier_timeout, agent_timeout=agent_timeout,
                                                  memory_mb=memory_mb, storage_mb=storage_mb,
                                                  verifier_extra=textwrap.dedent(verifier_extra)))
    (d / "environment" / "Dockerfile").write_text(dockerfile)
    (d / "tests" / "test.sh").write_text(test_sh)
    for rel, text in (tests or {}).items():
        (d / "tests" / rel).write_text(text)
    (d / "solution" / "solve.sh").write_text(solve)
    return d


def _docker_ok() -> bool:
    try:
        import docker

        client = docker.from_env()
        client.ping()
        client.images.get(BASE_IMAGE)
        return True
    except Exception:
        return False


DOCKER = _docker_ok()
needs_docker = pytest.mark.skipif(not DOCKER, reason=f"needs the Docker daemon and the local image {BASE_IMAGE}")
