"""Per-sandbox control groups on cgroup v1 or v2: memory, pids and CPU limits, and a kill of everything inside.

``CgroupSet.make(parent, name, memory_mb=..., pids=..., cpus=...)`` creates one group (v2) or one group
per controller (v1: ``memory``, ``pids``, ``cpu``) under ``parent``, writes the limits, and returns the
set; ``join(pid)`` (call it in the child before it execs: everything it starts inherits the groups),
``pids()``, ``kill()`` and ``remove()``. ``available()`` says which hierarchy is writable here
(only root can write one; inside a container the hierarchy is often read-only): without one, the
callers fall back to rlimits and say so.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["CGROUP_ROOT", "CgroupSet", "available"]

logger = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
V1_CONTROLLERS = ("memory", "pids", "cpu")


def available(root: Path = CGROUP_ROOT) -> str | None:
    """"v2", "v1" or None: which hierarchy this process can make limited groups in."""
    if os.geteuid() != 0:
        return None
    if (root / "cgroup.controllers").is_file():
        wanted = {"memory", "pids", "cpu"}
        have = set((root / "cgroup.controllers").read_text().split())
        return "v2" if wanted <= have and os.access(root, os.W_OK) else None
    if all(os.access(root / c, os.W_OK) for c in V1_CONTROLLERS):
        return "v1"
    return None


def _limits_v1(memory_mb: int, pids: int, cpus: float) -> dict[str, dict[str, str]]:
    return {"memory": {"memory.limit_in_bytes": str(memory_mb << 20)},
            "pids": {"pids.max": str(pids)},
            "cpu": {"cpu.cfs_period_us": "100000", "cpu.cfs_quota_us": str(int(cpus * 100000)) if cpus else "-1"}}


def _limits_v2(memory_mb: int, pids: int, cpus: float) -> dict[str, str]:
    return {"memory.max": str(memory_mb << 20), "memory.swap.max": "0", "pids.max": str(pids),
            "cpu.max": f"{int(cpus * 100000)} 100000" if cpus else "max 100000"}


@dataclass
class CgroupSet:
    """The groups of one sandbox (see the module docstring)."""

    paths: list[Path] = field(default_factory=list)
    version: str = ""

    @classmethod
    def make(cls, parent: str, name: str, *, memory_mb: int, pids: int, cpus: float,
             root: Path = CGROUP_ROOT) -> CgroupSet:  # fmt: skip
        """Create the groups with their limits; an empty set where no hierarchy is writable."""
        version = available(root)
        made = cls(version=version or "")
        if version == "v2":
            base = root / parent
            _enable_v2(root, base)
            group = base / name
            group.mkdir(exist_ok=True)
            made.paths.append(group)
            for key, value in _limits_v2(memory_mb, pids, cpus).items():
                try:
                    (group / key).write_text(value)
                except OSError as e:  # memory.swap.max is absent without swap accounting
                    if key != "memory.swap.max":
                        made.remove()
                        raise OSError(f"cgroup {group}/{key} = {value}: {e}") from e
        elif version == "v1":
            for ctrl, files in _limits_v1(memory_mb, pids, cpus).items():
                group = root / ctrl / parent / name
                group.mkdir(parents=True, exist_ok=True)
                made.paths.append(group)
                for key, value in files.items():
                    (group / key).write_text(value)
        return made

    def join(self, pid: int = 0) -> None:
        """Move a process (default: the calling one) into every group of the set."""
        for group in self.paths:
            (group / "cgroup.procs").write_text(str(pid or os.getpid()))

    def pids(self) -> set[int]:
        found: set[int] = set()
        for group in self.paths:
            try:
                found.update(int(p) for p in (group / "cgroup.procs").read_text().split())
            except (OSError, ValueError):
                pass
        return found

    def kill(self) -> None:
        """SIGKILL everything inside (v2: ``cgroup.kill``, atomic against forks; v1: freeze-free sweeps
        until empty, which callers pair with a PID namespace whose init dies)."""
        for group in self.paths:
            if (group / "cgroup.kill").exists():
                try:
                    (group / "cgroup.kill").write_text("1")
                    continue
                except OSError:
                    pass
            for pid in self.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass

    def remove(self, timeout: float = 3.0) -> bool:
        """Kill what is left and remove the groups; False if one still held a process at the timeout."""
        deadline = time.monotonic() + timeout
        while True:
            left = [g for g in self.paths if not _rmdir(g)]
            if not left:
                self.paths = []
                return True
            if time.monotonic() > deadline:
                self.paths = left
                return False
            self.kill()
            time.sleep(0.01)


def _enable_v2(root: Path, base: Path) -> None:
    """Make every level from the root down to ``base`` hand the memory, pids and cpu controllers on."""
    base.mkdir(parents=True, exist_ok=True)
    levels = [root] + [root.joinpath(*base.relative_to(root).parts[:i + 1]) for i in range(len(base.relative_to(root).parts))]
    for parent in levels:
        have = set((parent / "cgroup.subtree_control").read_text().split())
        missing = {"memory", "pids", "cpu"} - have
        if missing:
            (parent / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in sorted(missing)))


def _rmdir(group: Path) -> bool:
    try:
        group.rmdir()
        return True
    except FileNotFoundError:
        return True
    except OSError as e:  # still holding a dying process
        logger.debug("cgroup %s not removed yet: %s", group, e)
        return False
