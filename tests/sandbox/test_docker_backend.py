"""Docker backend start-up: guarantees are probed for real (a weakened runner is refused, naming the
guarantee), and a backend removes only the containers of its own instance id."""

from __future__ import annotations

import asyncio
import subprocess

import pytest


def weakened(cls, change):
    class Weakened(cls):
        def _flags(self, name):
            return change(super()._flags(name))

    return Weakened


def _swap(flags, old, new):
    i = next(i for i in range(len(flags)) if flags[i:i + len(old)] == old)
    return flags[:i] + new + flags[i + len(old):]


@pytest.mark.parametrize("guarantee,change", [
    ("non_root_uid", lambda f: _swap(f, ["--user", "10001:10001"], ["--user", "0:0"])),
    ("no_network", lambda f: _swap(f, ["--network", "none"], ["--network", "bridge"])),
    ("read_only_system", lambda f: _swap(f, ["--read-only"], [])),
    ("no_capabilities", lambda f: f + ["--cap-add", "SYS_PTRACE"]),
    ("no_capabilities", lambda f: _swap(f, ["--security-opt", "no-new-privileges"], [])),
    ("own_pid_namespace", lambda f: f + ["--pid", "host"]),
    ("clean_env", lambda f: f + ["--env", "LEAKED_TOKEN=x"]),
])
def test_a_weakened_runner_is_refused_naming_the_guarantee(docker_backend_cls, guarantee, change):
    from verl_agent.sandbox.backends.docker import IsolationError

    with pytest.raises(IsolationError, match=f"guarantee failed at start-up: {guarantee} .*refusing to serve"):
        weakened(docker_backend_cls, change)(memory_mb=256, pids=32, tmpfs_mb=16)


def test_guarantees_are_measured(docker_backend_cls):
    backend = docker_backend_cls(memory_mb=256, pids=32, tmpfs_mb=16)
    assert backend.guarantees() == dict.fromkeys(backend.guarantees(), True) and len(backend.guarantees()) == 11
    ok, detail = backend._guarantees["memory_limit"]
    assert ok and detail == f"memory limit {256 << 20}"  # read inside the container, not our own setting


def _running(instance_id: str) -> list[str]:
    from verl_agent.sandbox.backends.docker import SERVER_LABEL

    out = subprocess.run(["docker", "ps", "-aq", "--filter", f"label={SERVER_LABEL}={instance_id}"],
                         capture_output=True, text=True)
    return out.stdout.split()


def test_a_server_removes_only_its_own_containers(docker_backend_cls):
    async def scenario():
        mine = docker_backend_cls(memory_mb=256, pids=32, tmpfs_mb=16)
        worker = await mine.spawn()
        await worker.ready(60)
        try:
            assert len(_running(mine.instance_id)) == 1
            other = docker_backend_cls(memory_mb=256, pids=32, tmpfs_mb=16)  # another server starting up ...
            await other.close()  # ... and shutting down
            assert len(_running(mine.instance_id)) == 1, "another server removed our container"
            # a restarted server with our instance id removes what we left (as after a crash)
            await asyncio.to_thread(docker_backend_cls, memory_mb=256, pids=32, tmpfs_mb=16,
                                    instance_id=mine.instance_id)
            assert _running(mine.instance_id) == []
        finally:
            await worker.destroy()
            await mine.close()

    asyncio.run(scenario())
