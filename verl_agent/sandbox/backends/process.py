"""``process`` backend: bubblewrap namespaces + rlimits + cgroup v1 limits, for hosts without Docker.

Each sandbox is ``bwrap --unshare-all`` (no network interface but lo, own PID/IPC/UTS/user
namespaces), the host's /usr read-only, a private size-limited /tmp, /var/tmp and /dev, a clean
environment, run as a dedicated non-root uid when the server is root. Where cgroup v1 ``memory``,
``pids`` and ``cpu`` hierarchies are writable, each sandbox gets its own group with limits; otherwise
only rlimits apply and ``guarantees()`` says so.
"""

from __future__ import annotations

import logging
import os
import resource
import shutil
from pathlib import Path

from verl_agent.sandbox.backends.base import SandboxBackend, Worker, agent_argv
from verl_agent.sandbox.languages import available_languages

logger = logging.getLogger(__name__)

__all__ = ["ProcessBackend"]

CGROUP_ROOT = Path("/sys/fs/cgroup")
_ETC = ["/etc/alternatives", "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime"]


class ProcessBackend(SandboxBackend):
    name = "process"

    def __init__(self, uid: int = 10001, memory_mb: int = 1024, pids: int = 128, cpus: float = 1.0,
                 tmpfs_mb: int = 64, nproc: int = 4096):
        self.bwrap = shutil.which("bwrap")
        if self.bwrap is None:
            raise RuntimeError("process backend needs bubblewrap: apt-get install -y bubblewrap")
        self.uid = uid if os.geteuid() == 0 else None
        self.memory_mb, self.pids, self.cpus, self.tmpfs_mb, self.nproc = memory_mb, pids, cpus, tmpfs_mb, nproc
        self._cgroups = self._cgroup_ok()

    def _cgroup_ok(self) -> bool:
        return os.geteuid() == 0 and all(os.access(CGROUP_ROOT / c, os.W_OK) for c in ("memory", "pids", "cpu"))

    def guarantees(self) -> dict[str, bool]:
        return {
            "no_network": True, "own_pid_namespace": True, "private_tmp": True, "read_only_system": True,
            "clean_env": True, "non_root_uid": self.uid is not None or os.geteuid() != 0,
            "memory_limit": self._cgroups, "pids_limit": self._cgroups, "cpu_limit": self._cgroups,
            "disk_limit": True,
        }

    def languages(self) -> list[str]:
        return available_languages(lambda p: os.path.exists(p))

    def _argv(self) -> list[str]:
        size = str(self.tmpfs_mb << 20)
        argv = [self.bwrap, "--unshare-all", "--die-with-parent", "--as-pid-1", "--new-session",
                "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
                "--symlink", "usr/lib64", "/lib64", "--symlink", "usr/sbin", "/sbin",
                "--proc", "/proc", "--dev", "/dev", "--size", size, "--tmpfs", "/tmp",
                "--size", size, "--tmpfs", "/var/tmp", "--size", size, "--tmpfs", "/dev/shm",
                "--hostname", "sandbox", "--clearenv", "--setenv", "PATH", "/usr/bin:/bin",
                "--chdir", "/tmp"]
        for path in _ETC:
            argv += ["--ro-bind-try", path, path]
        return argv + ["--remount-ro", "/", "--"] + agent_argv()  # bwrap's root tmpfs: read-only too

    def _preexec(self, groups: list[Path]):
        """Runs in the child before exec: join the cgroups (before bwrap forks), limits, drop root."""
        nproc, uid = self.nproc, self.uid

        def apply() -> None:
            os.setsid()
            for group in groups:
                (group / "cgroup.procs").write_text(str(os.getpid()))
            resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))
            if uid is not None:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)

        return apply

    async def spawn(self) -> Worker:
        name = self.new_name("verl-sbx-proc")
        groups = self._make_cgroups(name) if self._cgroups else []
        kwargs: dict = {"preexec_fn": self._preexec(groups), "env": {"PATH": "/usr/bin:/bin"}, "cwd": "/"}
        try:
            proc = await self.start_process(self._argv(), **kwargs)
        except OSError:
            for group in groups:
                _remove_cgroup(group)
            raise

        async def destroy() -> None:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            for group in groups:
                _remove_cgroup(group)

        return Worker(name, proc, destroy)

    def _make_cgroups(self, name: str) -> list[Path]:
        limits = {
            "memory": {"memory.limit_in_bytes": str(self.memory_mb << 20)},
            "pids": {"pids.max": str(self.pids)},
            "cpu": {"cpu.cfs_period_us": "100000", "cpu.cfs_quota_us": str(int(self.cpus * 100000))},
        }
        made = []
        for ctrl, files in limits.items():
            group = CGROUP_ROOT / ctrl / "verl-sandbox" / name
            try:
                group.mkdir(parents=True, exist_ok=True)
                for key, value in files.items():
                    (group / key).write_text(value)
                made.append(group)
            except OSError as e:
                logger.warning("cgroup %s for %s not applied: %s", ctrl, name, e)
        return made


def _remove_cgroup(group: Path) -> None:
    try:
        group.rmdir()
    except OSError as e:  # a group still holding a dying process; the next cleanup sweep retries
        logger.debug("cgroup %s not removed yet: %s", group, e)
