"""``docker`` backend: one long-lived runner container per warm worker, the agent as its PID 1.

The container is started with ``docker run -i`` and the agent speaks over the attached stdin/stdout,
so a run costs no ``docker exec`` and nothing is created on the request path. Every container:
``--network none``, a non-root uid, ``--cap-drop ALL``, ``no-new-privileges``, read-only root, size-
limited tmpfs /tmp and /var/tmp owned by the run uid, memory/pids/CPU limits, private IPC, no log
driver (output never lands on the host disk), and only Docker's own PATH/HOSTNAME/HOME in its env.

Guarantees are measured, not assumed: at start-up one probe container is started with exactly the
runner's flags and reports its uid, interfaces, root mount, capability sets, PID, environment and
cgroup limits; ``guarantees()`` returns what it measured, and any failed guarantee refuses the
backend (``IsolationError`` naming it), so a server never serves on a weakened sandbox.

Containers carry two labels: ``verl-agent.sandbox=1`` and ``verl-agent.sandbox.server=<instance
id>``. A backend only ever removes containers with its own instance id: pass the same
``instance_id`` to a restarted server to remove what its crashed predecessor left behind; another
server's containers on the same host are never touched.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import subprocess
import uuid

from verl_agent.sandbox.backends.base import SandboxBackend, Worker, agent_argv
from verl_agent.sandbox.backends.probe import GUARANTEES, PROBE, IsolationError, judge, parse_probe
from verl_agent.sandbox.languages import LANGUAGES

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_IMAGE", "DockerBackend", "IsolationError", "docker_available", "remove_containers"]

DEFAULT_IMAGE = "verl-agent-sandbox-runner:latest"
LABEL = "verl-agent.sandbox=1"
SERVER_LABEL = "verl-agent.sandbox.server"

def docker_available(timeout: float = 10.0) -> bool:
    """True when the docker CLI exists and the daemon answers."""
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=timeout).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def remove_containers(instance_id: str) -> int:
    """Remove the runner containers labelled with ``instance_id`` (and no other); returns how many."""
    found = subprocess.run(["docker", "ps", "-aq", "--filter", f"label={SERVER_LABEL}={instance_id}"],
                           capture_output=True, text=True)
    ids = found.stdout.split()
    if ids:
        subprocess.run(["docker", "rm", "-f", *ids], capture_output=True)
        logger.info("removed %d sandbox containers of instance %s", len(ids), instance_id)
    return len(ids)


class DockerBackend(SandboxBackend):
    name = "docker"

    def __init__(self, image: str = DEFAULT_IMAGE, uid: int = 10001, memory_mb: int = 1024, pids: int = 128,
                 cpus: float = 1.0, tmpfs_mb: int = 64, instance_id: str | None = None):
        if not docker_available():
            raise RuntimeError("docker backend: the docker daemon does not answer (run scripts/setup_docker.sh)")
        probe = subprocess.run(["docker", "image", "inspect", image], capture_output=True)
        if probe.returncode != 0:
            raise RuntimeError(f"docker backend: image {image!r} is missing (run `verl-agent sandbox build-image`)")
        self.image, self.uid, self.memory_mb, self.pids, self.cpus, self.tmpfs_mb = (
            image, uid, memory_mb, pids, cpus, tmpfs_mb)
        self.instance_id = instance_id or uuid.uuid4().hex
        if not self.instance_id.replace("-", "").isalnum():
            raise ValueError(f"docker backend: instance_id must be letters, digits and '-', got {instance_id!r}")
        self.remove_stale()  # only ours: a predecessor with the same instance id
        self._guarantees = self.probe()

    def guarantees(self) -> dict[str, bool]:
        return {k: ok for k, (ok, _) in self._guarantees.items()}

    def probe(self) -> dict[str, tuple[bool, str]]:
        """Start one container with the runner's flags and measure every guarantee; refuse on a failure."""
        want = {"memory": self.memory_mb << 20, "pids": self.pids, "tmp": self.tmpfs_mb << 20}
        argv = ["docker", "run", "--rm", *self._flags(self.new_name("verl-sbx-probe")), self.image,
                "/usr/bin/python3", "-I", "-c", PROBE, json.dumps(want)]
        done = None
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
            found = parse_probe(done.stdout)
        except (OSError, subprocess.TimeoutExpired, ValueError, IndexError, TypeError) as e:
            why = (done is not None and done.stderr.strip()[-300:]) or f"{type(e).__name__}: {e}"
            raise IsolationError(f"docker backend: the isolation probe did not run ({why}); refusing to serve") from e
        judge("docker", found, set(GUARANTEES))  # docker claims every guarantee
        logger.info("docker backend %s: every guarantee probed and holds: %s", self.instance_id, sorted(found))
        return found

    def languages(self) -> list[str]:
        return list(LANGUAGES)  # the runner image carries python3, bash, gcc/g++ and nodejs

    def _flags(self, name: str) -> list[str]:
        uid = f"{self.uid}"
        tmpfs = f"rw,exec,nosuid,nodev,size={self.tmpfs_mb}m,uid={uid},gid={uid},mode=0700"
        return [
            "--name", name, "--label", LABEL, "--label", f"{SERVER_LABEL}={self.instance_id}",
            "--network", "none", "--log-driver", "none", "--user", f"{uid}:{uid}", "--cap-drop", "ALL",
            "--security-opt", "no-new-privileges", "--read-only", "--ipc", "private", "--hostname", "sandbox",
            "--tmpfs", f"/tmp:{tmpfs}", "--tmpfs", f"/var/tmp:{tmpfs}", "--shm-size", f"{self.tmpfs_mb}m",
            "--memory", f"{self.memory_mb}m", "--memory-swap", f"{self.memory_mb}m",
            "--pids-limit", str(self.pids), "--cpus", str(self.cpus), "--ulimit", "nofile=1024:1024",
            "--ulimit", "core=0", "--workdir", "/tmp",
        ]

    def _argv(self, name: str) -> list[str]:
        return ["docker", "run", "-i", "--rm", *self._flags(name), self.image, *agent_argv()]

    async def spawn(self) -> Worker:
        name = self.new_name("verl-sbx")
        proc = await self.start_process(self._argv(name))

        async def destroy() -> None:
            rm = await asyncio.create_subprocess_exec(
                "docker", "rm", "-f", name, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
            await rm.wait()

        return Worker(name, proc, destroy)

    def remove_stale(self) -> int:
        """Remove runner containers with this backend's instance id (never another server's)."""
        return remove_containers(self.instance_id)

    async def close(self) -> None:
        await asyncio.to_thread(self.remove_stale)
