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
from verl_agent.sandbox.languages import LANGUAGES

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_IMAGE", "DockerBackend", "IsolationError", "docker_available"]

DEFAULT_IMAGE = "verl-agent-sandbox-runner:latest"
LABEL = "verl-agent.sandbox=1"
SERVER_LABEL = "verl-agent.sandbox.server"

# Runs as PID 1 of a container started with the runner's flags; prints {guarantee: [ok, detail]}.
# Nothing leaves the container: the network check only connects when lo is the sole interface
# (then the connect fails at once with ENETUNREACH).
PROBE = r'''
import errno, json, os, socket, sys
want = json.loads(sys.argv[1])
r = {}
r["non_root_uid"] = (0 not in (os.getuid(), os.geteuid(), os.getgid(), os.getegid()), f"uid {os.getuid()}")
names = sorted(n for _, n in socket.if_nameindex())
net = names == ["lo"]
if net:
    s = socket.socket()
    s.settimeout(2)
    try:
        s.connect(("203.0.113.1", 80))
        net = False
    except OSError as e:
        net = e.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH)
    finally:
        s.close()
r["no_network"] = (net, f"interfaces {names}")
r["read_only_system"] = (bool(os.statvfs("/").f_flag & os.ST_RDONLY), "root mount read-only flag")
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
caps = {k: status[k].strip() for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb") if k in status}
r["no_capabilities"] = (len(caps) == 5 and all(int(v, 16) == 0 for v in caps.values())
                        and status.get("NoNewPrivs", "").strip() == "1", f"{caps} NoNewPrivs={status.get('NoNewPrivs', '?').strip()}")
r["own_pid_namespace"] = (os.getpid() == 1, f"pid {os.getpid()}")
env = [e.split(b"=", 1)[0].decode() for e in open("/proc/self/environ", "rb").read().split(b"\0") if e]
extra = sorted(set(env) - {"PATH", "HOSTNAME", "HOME"})  # as exec'd: python's own LC_CTYPE coercion aside
r["clean_env"] = (not extra, f"extra variables {extra}")
def first(*paths):
    for p in paths:
        try:
            return open(p).read().split()[0]
        except OSError:
            pass
    return None
mem = first("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory.max")
r["memory_limit"] = (mem is not None and mem.isdigit() and int(mem) <= want["memory"], f"memory limit {mem}")
pids = first("/sys/fs/cgroup/pids/pids.max", "/sys/fs/cgroup/pids.max")
r["pids_limit"] = (pids is not None and pids.isdigit() and int(pids) <= want["pids"], f"pids.max {pids}")
cpu = first("/sys/fs/cgroup/cpu/cpu.cfs_quota_us", "/sys/fs/cgroup/cpu.max")
r["cpu_limit"] = (cpu is not None and cpu.lstrip("-").isdigit() and int(cpu) > 0, f"cpu quota {cpu}")
tmp = {}
for d in ("/tmp", "/var/tmp"):
    st = os.statvfs(d)
    tmp[d] = st.f_blocks * st.f_frsize
mounts = {line.split()[1]: line.split()[2] for line in open("/proc/mounts")}
r["disk_limit"] = (all(0 < v <= want["tmp"] for v in tmp.values()), f"scratch sizes {tmp}")
r["private_tmp"] = (all(mounts.get(d) == "tmpfs" for d in tmp) and os.access("/tmp", os.W_OK), f"mounts {[mounts.get(d) for d in tmp]}")
print(json.dumps(r))
'''


class IsolationError(RuntimeError):
    """A guarantee of the threat model does not hold on this host; the backend refuses to serve."""


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
        try:
            done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
            found = {k: (bool(v[0]), str(v[1])) for k, v in json.loads(done.stdout.strip().splitlines()[-1]).items()}
        except (OSError, subprocess.TimeoutExpired, ValueError, IndexError, TypeError) as e:
            why = (locals().get("done") and done.stderr.strip()[-300:]) or f"{type(e).__name__}: {e}"
            raise IsolationError(f"docker backend: the isolation probe did not run ({why}); refusing to serve") from e
        failed = {k: detail for k, (ok, detail) in found.items() if not ok}
        if failed:
            names = ", ".join(f"{k} ({detail})" for k, detail in failed.items())
            raise IsolationError(f"docker backend: isolation guarantee failed at start-up: {names}; refusing to serve")
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
        found = subprocess.run(["docker", "ps", "-aq", "--filter", f"label={SERVER_LABEL}={self.instance_id}"],
                               capture_output=True, text=True)
        ids = found.stdout.split()
        if ids:
            subprocess.run(["docker", "rm", "-f", *ids], capture_output=True)
            logger.info("removed %d sandbox containers of instance %s", len(ids), self.instance_id)
        return len(ids)

    async def close(self) -> None:
        await asyncio.to_thread(self.remove_stale)
