"""``docker`` backend: one long-lived runner container per warm worker, the agent as its PID 1.

The container is started with ``docker run -i`` and the agent speaks over the attached stdin/stdout,
so a run costs no ``docker exec`` and nothing is created on the request path. Every container:
``--network none``, a non-root uid, ``--cap-drop ALL``, ``no-new-privileges``, read-only root, size-
limited tmpfs /tmp and /var/tmp owned by the run uid, memory/pids/CPU limits, private IPC, no log
driver (output never lands on the host disk), and only Docker's own PATH/HOSTNAME/HOME in its env.
Containers carry a label so a restarted server removes what a crashed one left behind.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import subprocess

from verl_agent.sandbox.backends.base import SandboxBackend, Worker, agent_argv
from verl_agent.sandbox.languages import LANGUAGES

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_IMAGE", "DockerBackend", "docker_available"]

DEFAULT_IMAGE = "verl-agent-sandbox-runner:latest"
LABEL = "verl-agent.sandbox=1"


def docker_available(timeout: float = 10.0) -> bool:
    """True when the docker CLI exists and the daemon answers."""
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=timeout).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


class DockerBackend(SandboxBackend):
    name = "docker"

    def __init__(self, image: str = DEFAULT_IMAGE, uid: int = 10001, memory_mb: int = 1024, pids: int = 128,
                 cpus: float = 1.0, tmpfs_mb: int = 64):
        if not docker_available():
            raise RuntimeError("docker backend: the docker daemon does not answer (run scripts/setup_docker.sh)")
        probe = subprocess.run(["docker", "image", "inspect", image], capture_output=True)
        if probe.returncode != 0:
            raise RuntimeError(f"docker backend: image {image!r} is missing (run `verl-agent sandbox build-image`)")
        self.image, self.uid, self.memory_mb, self.pids, self.cpus, self.tmpfs_mb = (
            image, uid, memory_mb, pids, cpus, tmpfs_mb)
        self.remove_stale()

    def guarantees(self) -> dict[str, bool]:
        keys = ["no_network", "own_pid_namespace", "private_tmp", "read_only_system", "clean_env", "non_root_uid",
                "memory_limit", "pids_limit", "cpu_limit", "disk_limit", "no_capabilities"]
        return dict.fromkeys(keys, True)

    def languages(self) -> list[str]:
        return list(LANGUAGES)  # the runner image carries python3, bash, gcc/g++ and nodejs

    def _argv(self, name: str) -> list[str]:
        uid = f"{self.uid}"
        tmpfs = f"rw,exec,nosuid,nodev,size={self.tmpfs_mb}m,uid={uid},gid={uid},mode=0700"
        return [
            "docker", "run", "-i", "--rm", "--name", name, "--label", LABEL, "--network", "none",
            "--log-driver", "none", "--user", f"{uid}:{uid}", "--cap-drop", "ALL",
            "--security-opt", "no-new-privileges", "--read-only", "--ipc", "private", "--hostname", "sandbox",
            "--tmpfs", f"/tmp:{tmpfs}", "--tmpfs", f"/var/tmp:{tmpfs}", "--shm-size", f"{self.tmpfs_mb}m",
            "--memory", f"{self.memory_mb}m", "--memory-swap", f"{self.memory_mb}m",
            "--pids-limit", str(self.pids), "--cpus", str(self.cpus), "--ulimit", "nofile=1024:1024",
            "--ulimit", "core=0", "--workdir", "/tmp", self.image, *agent_argv(),
        ]

    async def spawn(self) -> Worker:
        name = self.new_name("verl-sbx")
        proc = await self.start_process(self._argv(name))

        async def destroy() -> None:
            rm = await asyncio.create_subprocess_exec(
                "docker", "rm", "-f", name, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
            await rm.wait()

        return Worker(name, proc, destroy)

    @staticmethod
    def remove_stale() -> int:
        """Remove runner containers left by a server that died (they carry our label)."""
        found = subprocess.run(["docker", "ps", "-aq", "--filter", f"label={LABEL}"], capture_output=True, text=True)
        ids = found.stdout.split()
        if ids:
            subprocess.run(["docker", "rm", "-f", *ids], capture_output=True)
            logger.info("removed %d stale sandbox containers", len(ids))
        return len(ids)

    async def close(self) -> None:
        await asyncio.to_thread(self.remove_stale)
