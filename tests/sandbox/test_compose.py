"""`verl-agent sandbox up` / `down` for real (issue 19): the server image is built offline on top of the
runner image (reused when unchanged), compose starts it, the official ``sandbox-fusion`` client runs
code through it, and ``down`` leaves no container of its instance behind."""

from __future__ import annotations

import socket
import subprocess
import sys
import uuid

import httpx
import pytest

from verl_agent.sandbox.backends.docker import SERVER_LABEL


def _containers(label: str) -> list[str]:
    out = subprocess.run(["docker", "ps", "-aq", "--filter", f"label={label}"], capture_output=True, text=True)
    return out.stdout.split()


def test_compose_up_health_run_code_down(docker_backend_cls):
    from sandbox_fusion import RunCodeRequest, RunStatus, run_code, set_sandbox_endpoint

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    instance = "test-" + uuid.uuid4().hex[:12]
    project = "verl-agent-sandbox-" + instance
    cli = [sys.executable, "-m", "verl_agent.sandbox.cli"]
    up = subprocess.run([*cli, "up", "--port", str(port), "--instance-id", instance, "--project", project,
                         "--min-pool-size", "1", "--max-pool-size", "2"], capture_output=True, text=True, timeout=600)
    try:
        assert up.returncode == 0, up.stdout[-2000:] + up.stderr[-2000:]
        assert f"sandbox server up at http://127.0.0.1:{port}" in up.stdout
        health = httpx.get(f"http://127.0.0.1:{port}/v1/health", timeout=10).json()
        assert health["backend"] == "docker" and all(health["guarantees"].values()), health
        assert health["pool"]["min_pool_size"] == 1 and health["pool"]["max_pool_size"] == 2
        set_sandbox_endpoint(f"http://127.0.0.1:{port}")
        out = run_code(RunCodeRequest(code="import sys\nprint(sum(map(int, sys.stdin.read().split())))",
                                      language="python", stdin="20 22"), max_attempts=1)
        assert out.status == RunStatus.Success and out.run_result.stdout == "42\n", out
        assert out.executor_pod_name.startswith("verl-sbx-")
        assert _containers(f"{SERVER_LABEL}={instance}")  # its runner containers, labelled with its id
    finally:
        down = subprocess.run([*cli, "down", "--instance-id", instance, "--project", project],
                              capture_output=True, text=True, timeout=300)
    assert down.returncode == 0, down.stderr[-2000:]
    assert _containers(f"{SERVER_LABEL}={instance}") == []
    assert _containers(f"com.docker.compose.project={project}") == []
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/v1/ping", timeout=2)


def test_compose_file_takes_its_port_from_the_cli(capfd):
    """compose.yaml has no port of its own: the CLI passes --port, or DEFAULT_PORT (also for `down`)."""
    from verl_agent.sandbox.api import DEFAULT_PORT
    from verl_agent.sandbox.cli import _compose

    assert _compose("verl-agent-sandbox-config-check", {}, "config") == 0
    assert f"--port={DEFAULT_PORT}" in capfd.readouterr().out
    assert _compose("verl-agent-sandbox-config-check", {"VERL_AGENT_SANDBOX_PORT": "9123"}, "config") == 0
    out = capfd.readouterr().out
    assert "--port=9123" in out and "127.0.0.1:9123/v1/ping" in out
