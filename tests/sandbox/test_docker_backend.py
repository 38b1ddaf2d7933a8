"""Docker backend start-up: guarantees are probed for real (a weakened runner is refused, naming the
guarantee), a backend removes only the containers of its own instance id, and a sandbox starts at a high
CPU weight, without Docker's network hook."""

from __future__ import annotations

import asyncio
import json
import subprocess

import pytest

from verl_agent.sandbox.backends.probe import GUARANTEES, IsolationError, judge


@pytest.mark.parametrize("guarantee", GUARANTEES)
def test_a_weakened_runner_is_refused_naming_the_guarantee(docker_backend_cls, guarantee):
    """Every guarantee, removed alone (the backend's test-only ``weaken``), is measured as failed by the
    start-up probe; the backend, which claims every guarantee, refuses to serve naming it."""
    backend = docker_backend_cls(memory_mb=256, pids=32, tmpfs_mb=16, uid=31000, weaken=frozenset({guarantee}))
    try:
        ok, detail = backend._guarantees[guarantee]
        assert not ok and not backend.guarantees()[guarantee], detail
        with pytest.raises(IsolationError, match=f"guarantee failed at start-up: .*{guarantee} .*refusing to serve"):
            judge("docker", backend._guarantees, set(GUARANTEES))
    finally:
        asyncio.run(backend.close())


def test_no_capabilities_is_refused_without_no_new_privileges(docker_backend_cls):
    """no-new-privileges alone dropped (capability sets still empty): the probe still names no_capabilities."""
    class Weakened(docker_backend_cls):
        def _config(self, cmd):
            config = super()._config(cmd)
            config["security_opt"] = []
            return config

    with pytest.raises(IsolationError, match="guarantee failed at start-up: .*no_capabilities .*refusing to serve"):
        Weakened(memory_mb=256, pids=32, tmpfs_mb=16)


def test_guarantees_are_measured(docker_backend_cls):
    backend = docker_backend_cls(memory_mb=256, pids=32, tmpfs_mb=16)
    from verl_agent.sandbox.backends.probe import GUARANTEES

    assert backend.guarantees() == dict.fromkeys(GUARANTEES, True) and len(GUARANTEES) == 12
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


def _inspect(name: str) -> dict:
    return json.loads(subprocess.run(["docker", "inspect", name], capture_output=True, text=True, check=True).stdout)[0]


def test_a_sandbox_starts_at_a_high_cpu_weight_without_the_network_hook_and_settles_when_ready(docker_backend_cls):
    """NetworkDisabled: Docker gives the container an empty network namespace and no libnetwork prestart hook
    (the probe's no_network guarantee still holds, see above); the starting container outweighs running
    sandboxes until its agent is ready, then weighs what they weigh."""
    from verl_agent.sandbox.backends.docker import CPU_SHARES, STARTING_CPU_SHARES

    async def scenario():
        backend = docker_backend_cls(memory_mb=256, pids=32, tmpfs_mb=16)
        worker = await backend.spawn()
        try:
            starting = await asyncio.to_thread(_inspect, worker.name)
            await worker.ready(60)
            ready = await asyncio.to_thread(_inspect, worker.name)
        finally:
            await worker.destroy()
            await backend.close()
        return starting, ready

    starting, ready = asyncio.run(scenario())
    assert starting["Config"]["NetworkDisabled"] is True and starting["HostConfig"]["NetworkMode"] == "none"
    assert (starting["HostConfig"]["CpuShares"], ready["HostConfig"]["CpuShares"]) == (STARTING_CPU_SHARES, CPU_SHARES)
    assert ready["HostConfig"]["NanoCpus"] == 10**9  # the CPU limit is untouched by the weight


def test_the_attach_stream_reports_a_killed_agent_with_its_exit_code(docker_backend_cls):
    """The agent's stdout comes over the API's attach stream (no docker CLI process): when the container's
    PID 1 dies the stream ends, the next call fails cleanly, and the exit code is Docker's (SIGKILL: 137)."""
    from verl_agent.sandbox.backends.base import WorkerError

    async def scenario():
        backend = docker_backend_cls(memory_mb=256, pids=32, tmpfs_mb=16)
        worker = await backend.spawn()
        try:
            await worker.ready(60)
            killed = await asyncio.create_subprocess_exec("docker", "kill", worker.name)
            assert await killed.wait() == 0
            with pytest.raises(WorkerError, match=r"(crashed|is gone) \(agent exited with 137\)"):
                await worker.call({"op": "run", "steps": [], "max_output": 100, "max_file": 100}, 30)
            assert worker.broken
        finally:
            await worker.destroy()
            await backend.close()
        assert _running(backend.instance_id) == []

    asyncio.run(scenario())
