"""``process`` backend: bubblewrap namespaces + rlimits + cgroup v1 limits, for hosts without Docker.

Each sandbox is ``bwrap --unshare-all`` (no network interface but lo, own PID/IPC/UTS/user
namespaces), the host's /usr read-only, a private size-limited /tmp, /var/tmp and /dev/shm, a
read-only /dev, a clean environment, run as a dedicated non-root uid when the server is root. bwrap and
the control groups come from the container layer (``verl_agent.containers``: ``find_bwrap``, ``CgroupSet``),
as the Harbor tasks' bwrap runtime's do. Where a cgroup v2 or v1 hierarchy with ``memory``, ``pids`` and
``cpu`` is writable, each sandbox gets its own groups with limits; otherwise only rlimits apply and
``guarantees()`` says so.

Probed, not assumed: at start-up one sandbox started exactly like a worker runs the shared probe
(``backends/probe.py``: uid, network, read-only root, capabilities, PID namespace, environment,
scratch mounts, nothing writable outside them) and the host checks from outside that it sits in its
cgroups with the configured limits. Every guarantee the backend claims (all of them, the cgroup
limits only where cgroup v1 is writable) must hold, or the backend refuses to serve
(``IsolationError`` naming it).

Cgroups live under ``verl-sandbox/<instance id>/``; a backend removes only its own instance's
groups, so a restarted server given the same ``instance_id`` cleans up after its predecessor.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import resource
import shutil
import subprocess
import threading
import uuid

from verl_agent.containers.bwrap import find_bwrap
from verl_agent.containers.cgroups import CGROUP_ROOT, CgroupSet, available
from verl_agent.sandbox.api import DEFAULT_MEMORY_MB
from verl_agent.sandbox.backends.base import SandboxBackend, Worker, agent_argv, shared_tmp
from verl_agent.sandbox.backends.probe import (
    GUARANTEES,
    PROBE,
    SCRATCH,
    IsolationError,
    check_weaken,
    judge,
    parse_probe,
    unclaimed,
)
from verl_agent.sandbox.languages import available_languages

logger = logging.getLogger(__name__)

__all__ = ["ProcessBackend"]

_ETC = ["/etc/alternatives", "/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime"]


class ProcessBackend(SandboxBackend):
    name = "process"

    def __init__(self, uid: int = 10001, memory_mb: int = DEFAULT_MEMORY_MB, pids: int = 128, cpus: float = 1.0,
                 tmpfs_mb: int = 64, nproc: int = 4096, instance_id: str | None = None,
                 weaken: frozenset[str] = frozenset()):
        try:
            self.bwrap = find_bwrap()
        except Exception as e:
            raise RuntimeError(f"process backend needs bubblewrap: {e}") from e
        self.weaken = check_weaken("process", weaken)  # test-only (probe.WEAKENINGS); never claimed
        self.uid = uid if os.geteuid() == 0 and "non_root_uid" not in self.weaken else None
        self._shared_tmp = shared_tmp(self.weaken)  # weakened private_tmp only
        self.memory_mb, self.pids, self.cpus, self.tmpfs_mb, self.nproc = memory_mb, pids, cpus, tmpfs_mb, nproc
        self.instance_id = instance_id or uuid.uuid4().hex
        if not self.instance_id.replace("-", "").isalnum():
            raise ValueError(f"process backend: instance_id must be letters, digits and '-', got {instance_id!r}")
        self._cgroups = self._cgroup_ok()
        if self._cgroups:
            self.remove_stale()  # only ours: a predecessor with the same instance id
        try:
            self._guarantees = self.probe()
        except IsolationError:
            if self._shared_tmp:
                shutil.rmtree(self._shared_tmp, ignore_errors=True)
            raise

    def _cgroup_ok(self) -> bool:
        return available() is not None

    def claimed(self) -> set[str]:
        """What this backend promises here: everything, the cgroup limits only where it can set them."""
        limits = {"memory_limit", "pids_limit", "cpu_limit"}
        return set(GUARANTEES) - (set() if self._cgroups else limits) - unclaimed(self.weaken)

    def guarantees(self) -> dict[str, bool]:
        return {k: ok and k in self.claimed() for k, (ok, _) in self._guarantees.items()}

    def probe(self) -> dict[str, tuple[bool, str]]:
        """Start one sandbox as a worker is started, measure every guarantee, refuse on a claimed failure."""
        name = self.new_name("verl-sbx-probe")
        groups = self._make_cgroups(name) if self._cgroups else CgroupSet()
        want = {"memory": self.memory_mb << 20, "pids": self.pids, "tmp": self.tmpfs_mb << 20, "scratch": SCRATCH,
                "cgroups_inside": False, "hold": True}
        argv = self._argv(["/usr/bin/python3", "-I", "-c", PROBE, json.dumps(want)])
        proc = None
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, preexec_fn=self._preexec(groups), env=self._env(), cwd="/")
            timer = threading.Timer(60.0, proc.kill)
            timer.start()
            try:
                line = proc.stdout.readline()
                found = parse_probe(line)
                found.update(self._probe_cgroups(proc.pid, groups))  # seen from the host, while it runs
            finally:
                timer.cancel()
        except (OSError, ValueError, TypeError) as e:
            why = f"{type(e).__name__}: {e}"
            if proc is not None:
                proc.kill()
                why += f"; stderr: {proc.stderr.read().strip()[-300:]}"
            raise IsolationError(f"process backend: the isolation probe did not run ({why}); refusing to serve") from e
        finally:
            if proc is not None:
                if proc.stdin:
                    proc.stdin.close()
                proc.wait()
            groups.remove()
        judge("process", found, self.claimed())
        logger.info("process backend %s: claimed guarantees probed and hold: %s", self.instance_id,
                    sorted(self.claimed()))
        return found

    def _probe_cgroups(self, pid: int, groups: CgroupSet) -> dict[str, tuple[bool, str]]:
        """The sandbox's cgroup membership and limits as the kernel reports them (``/proc/<pid>/cgroup``)."""
        if not self._cgroups:
            why = "no writable cgroup hierarchy (not claimed: rlimits only)"
            return {k: (False, why) for k in ("memory_limit", "pids_limit", "cpu_limit")}
        v2 = groups.version == "v2"
        member = {}
        with open(f"/proc/{pid}/cgroup") as f:
            for line in f.read().splitlines():
                _, ctrls, path = line.split(":", 2)
                if bool(ctrls) == v2:  # v2's one line has no controller names; a hybrid host shows both kinds
                    continue
                for ctrl in ctrls.split(",") if ctrls else ("memory", "pids", "cpu"):
                    member[ctrl] = path

        def limit(ctrl: str, key: str) -> str | None:
            try:
                return (CGROUP_ROOT / ("" if v2 else ctrl) / member.get(ctrl, "/").lstrip("/") / key).read_text().strip()
            except OSError:
                return None

        rel = [g.relative_to(CGROUP_ROOT).parts for g in groups.paths]  # ([controller,] "verl-sandbox", instance, name)
        mine = ({c: "/" + "/".join(rel[0]) for c in ("memory", "pids", "cpu")} if v2
                else {parts[0]: "/" + "/".join(parts[1:]) for parts in rel})
        inside = {c: member.get(c) == mine.get(c) for c in ("memory", "pids", "cpu")}
        mem = limit("memory", "memory.max" if v2 else "memory.limit_in_bytes")
        pids = limit("pids", "pids.max")
        cpu = limit("cpu", "cpu.max" if v2 else "cpu.cfs_quota_us")
        cpu = cpu.split()[0] if cpu else cpu
        mem_ok = mem is not None and mem.isdigit() and int(mem) <= self.memory_mb << 20
        return {
            "memory_limit": (inside["memory"] and mem_ok,
                             f"memory cgroup {member.get('memory')} limit {mem}"),
            "pids_limit": (inside["pids"] and pids is not None and pids.isdigit() and int(pids) <= self.pids,
                           f"pids cgroup {member.get('pids')} pids.max {pids}"),
            "cpu_limit": (inside["cpu"] and cpu is not None and cpu.lstrip("-").isdigit() and int(cpu) > 0,
                          f"cpu cgroup {member.get('cpu')} quota {cpu}"),
        }

    def languages(self) -> list[str]:
        return available_languages(lambda p: os.path.exists(p))

    def _env(self) -> dict[str, str]:
        return dict(os.environ) if self._host_env() else {"PATH": "/usr/bin:/bin"}

    def _host_env(self) -> bool:
        """Test-only: the sandbox gets the host's environment (weakened clean_env, or no_host_env)."""
        return bool(self.weaken & {"clean_env", "no_host_env"})

    def _argv(self, command: list[str] | None = None) -> list[str]:
        weak = self.weaken
        size = str((self.tmpfs_mb * (8 if "disk_limit" in weak else 1)) << 20)
        if "own_pid_namespace" in weak:
            unshare = ["--unshare-user-try", "--unshare-ipc", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
        else:
            unshare = ["--unshare-all", "--as-pid-1"]
        if self._shared_tmp:
            scratch = ["--bind", self._shared_tmp, "/tmp", "--bind", self._shared_tmp, "/var/tmp"]
        else:
            scratch = ["--size", size, "--tmpfs", "/tmp", "--size", size, "--tmpfs", "/var/tmp"]
        # Weakened own_pid_namespace (test-only): the supervisor's kill(-1) reaches its own bwrap too, and
        # dying with it would take the run's reply along; the cgroup kill on destroy ends the sandbox instead.
        die = [] if "own_pid_namespace" in weak else ["--die-with-parent"]
        argv = [self.bwrap, *unshare, *die, "--new-session",
                "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
                "--symlink", "usr/lib64", "/lib64", "--symlink", "usr/sbin", "/sbin",
                *(["--bind", "/proc", "/proc"] if "own_pid_namespace" in weak else ["--proc", "/proc"]),
                "--dev", "/dev", *scratch, "--size", size, "--tmpfs", "/dev/shm",
                "--hostname", "sandbox", *([] if self._host_env() else ["--clearenv"]),
                "--setenv", "PATH", "/usr/bin:/bin", "--chdir", "/tmp"]
        for path in _ETC:
            argv += ["--ro-bind-try", path, path]
        argv += ["--share-net"] if "no_network" in weak else []
        argv += ["--cap-add", "CAP_SYS_PTRACE"] if "no_capabilities" in weak else []
        argv += ["--cap-drop", "ALL"] if self.uid is None and os.geteuid() == 0 else []  # root: no capabilities
        # bwrap's root tmpfs and /dev read-only too: /dev is a tmpfs no run wipes, so a file written there
        # would outlive the run (the device nodes, /dev/pts and /dev/shm are mounts of their own and still work)
        argv += [] if "read_only_system" in weak else ["--remount-ro", "/"]
        argv += [] if "only_scratch_writable" in weak else ["--remount-ro", "/dev"]
        return argv + ["--"] + (command or agent_argv(weaken=weak))

    def _preexec(self, groups: CgroupSet):
        """Runs in the child before exec: join the cgroups (before bwrap forks), limits, drop root."""
        nproc, uid = self.nproc, self.uid
        nofile = 8192 if "fd_limit" in self.weaken else 1024

        def apply() -> None:
            os.setsid()
            groups.join()
            resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
            if uid is not None:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)

        return apply

    async def spawn(self) -> Worker:
        name = self.new_name("verl-sbx-proc")
        groups = self._make_cgroups(name) if self._cgroups else CgroupSet()
        kwargs: dict = {"preexec_fn": self._preexec(groups), "env": self._env(), "cwd": "/"}
        try:
            proc = await self.start_process(self._argv(), **kwargs)
        except OSError:
            groups.remove()
            raise

        async def destroy() -> None:
            if proc.returncode is None:
                proc.kill()
            # the sandbox's own processes die with bwrap (--die-with-parent) a moment later (without it, in a
            # test-only weakening, only here); a group can be removed only once they are gone, so kill what
            # is left and retry for a while. Then bwrap's exit is seen once they have closed its pipes.
            await asyncio.to_thread(groups.remove, 3.0)
            await proc.wait()

        return Worker(name, proc, destroy, weaken=self.weaken)

    def _make_cgroups(self, name: str) -> CgroupSet:
        weak = self.weaken  # weakened (test-only): memory x8, pids x16, no CPU quota
        try:
            return CgroupSet.make(f"verl-sandbox/{self.instance_id}", name,
                                  memory_mb=self.memory_mb * (8 if "memory_limit" in weak else 1),
                                  pids=self.pids * (16 if "pids_limit" in weak else 1),
                                  cpus=0 if "cpu_limit" in weak else self.cpus)
        except OSError as e:
            logger.warning("cgroups for %s not applied: %s", name, e)
            return CgroupSet()

    def remove_stale(self) -> int:
        """Kill what is left in this instance's cgroups and remove them (never another server's)."""
        roots = [CGROUP_ROOT / "verl-sandbox" / self.instance_id] + [
            CGROUP_ROOT / ctrl / "verl-sandbox" / self.instance_id for ctrl in ("memory", "pids", "cpu")]
        groups = [p for root in roots if root.is_dir() for p in root.iterdir() if p.is_dir()]
        CgroupSet(groups).remove(timeout=5.0)
        removed = sum(not g.exists() for g in groups)
        CgroupSet([root for root in roots if root.is_dir()]).remove(timeout=1.0)
        return removed

    async def close(self) -> None:
        if self._cgroups:
            await asyncio.to_thread(self.remove_stale)  # what is left of ours, and the instance's directory
        if self._shared_tmp:
            shutil.rmtree(self._shared_tmp, ignore_errors=True)
