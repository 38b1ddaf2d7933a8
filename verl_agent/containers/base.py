"""What every container runtime offers, and the data that crosses the seam.

A ``Runtime`` starts a container from an image (``start``), opens shells in it (``open_shell``: a
persistent ``bash`` whose stdin/stdout/stderr are one stream), interrupts a shell's running command
(``interrupt``) or ends a stuck one (``end_shell``), says whether the container still stands and, if not, whose doing that was
(``state``), and at the end of an episode stops everything the agent ran (``seal``), lists what the
agent changed against the image (``changes``), measures its disk (``disk_used``) and runs a verifier
on the final filesystem where no agent process exists any more (``verify``). ``destroy`` removes a
container; ``reap`` removes what dead owners left.

The runtimes: ``docker`` (a Docker daemon) and ``bwrap`` (bubblewrap over an unpacked root filesystem,
no daemon). ``get_runtime("auto")`` takes Docker when a daemon answers, else bwrap.
"""

from __future__ import annotations

import os
import socket
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "AGENT_KILLED",
    "CONTAINER_DEAD",
    "LABEL",
    "NODE_LABEL",
    "OWNER_LABEL",
    "ROOT_CAPS",
    "RUN_LABEL",
    "TASK_LABEL",
    "Channel",
    "Container",
    "ContainerError",
    "ContainerSpec",
    "ContainerState",
    "Runtime",
    "VerifierRun",
    "is_root",
    "owner_alive",
    "owner_id",
]

LABEL = "verl-agent.tasks"
RUN_LABEL, OWNER_LABEL, NODE_LABEL, TASK_LABEL = (f"{LABEL}.run", f"{LABEL}.owner", f"{LABEL}.node",
                                                  f"{LABEL}.task")
# A root agent keeps only what package-style file work needs; never KILL, SYS_ADMIN, NET_*, PTRACE, ...
ROOT_CAPS = ["CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "SETUID", "SETGID"]

AGENT_KILLED = "agent_killed_container"  # the agent ended its own container: a 0 charged to the agent
CONTAINER_DEAD = "container_dead"  # the container vanished for a reason the agent cannot cause: infrastructure


class ContainerError(RuntimeError):
    """A container could not be provided or used: infrastructure, never a reward."""

    def __init__(self, message: str, cause: str = "runtime_error") -> None:
        super().__init__(message)
        self.cause = cause


@dataclass(frozen=True)
class ContainerSpec:
    """What a trajectory container is started with; equal specs share a warm pool."""

    image: str
    user: str  # "" = the image's USER
    cpus: float
    memory_mb: int
    storage_mb: int
    pids: int = 512
    network: bool = False
    lifetime_s: int = 4 * 3600


@dataclass
class Container:
    """A started container. ``handle`` is the runtime's own (picklable: a pool in another process hands
    containers to the processes that use them)."""

    id: str
    spec: ContainerSpec
    runtime: str
    user: str  # the agent's user
    workdir: str
    labels: dict[str, str] = field(default_factory=dict)
    handle: dict[str, Any] = field(default_factory=dict)


@dataclass
class Channel:
    """One open shell: a socket carrying its stdin and its merged stdout/stderr."""

    sock: socket.socket
    framed: bool  # Docker's exec stream: 8-byte frame headers around every chunk of output
    host_pid: int = 0  # the shell's pid on this host, where the runtime knows it (bwrap)


@dataclass
class ContainerState:
    running: bool
    cause: str = ""  # when not running: AGENT_KILLED or CONTAINER_DEAD
    detail: str = ""


@dataclass
class VerifierRun:
    exit_code: int | None  # None: timed out
    output: str
    files: dict[str, bytes]  # the files the verifier left in /logs/verifier (by name)


def upper_changes(upper: Path) -> list[str]:
    """What an overlay's upper layer holds, as absolute paths of the merged tree: every file the container
    added or changed, and (as whiteouts) every one it deleted."""
    return ["/" + os.path.relpath(os.path.join(dirpath, name), upper)
            for dirpath, dirnames, filenames in os.walk(upper) for name in dirnames + filenames]


def is_root(user: str) -> bool:
    """Does `user` ("name", "uid" or "uid:gid"; "" = root) name root?"""
    return user in ("", "0", "root") or user.startswith(("0:", "root:"))


def _start_time(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[19]


def owner_id(pid: int | None = None) -> str:
    """``host:pid:start time`` of a process (default: this one): unique even when pids are reused."""
    pid = pid or os.getpid()
    return f"{socket.gethostname()}:{pid}:{_start_time(pid)}"


def owner_alive(owner: str) -> bool | None:
    """Is the owner process alive? None when it ran on another host (cannot be told from here)."""
    try:
        host, pid, start = owner.rsplit(":", 2)
    except ValueError:
        return None
    if host != socket.gethostname():
        return None
    try:
        return _start_time(int(pid)) == start
    except (OSError, ValueError, IndexError):
        return False


class Runtime(ABC):
    """See the module docstring. Methods block: call them in threads, never on an event loop."""

    name: str = ""
    ncpu: float = float(os.cpu_count() or 1)

    @abstractmethod
    def image_info(self, image: str) -> tuple[str, str]:
        """(USER, WORKDIR) of an image."""

    @abstractmethod
    def start(self, spec: ContainerSpec, labels: dict[str, str]) -> Container:
        """A started container, nothing of the agent running in it yet."""

    @abstractmethod
    def open_shell(self, c: Container, env: dict[str, str]) -> Channel:
        """``bash --noprofile --norc`` as the container's user in its working directory."""

    @abstractmethod
    def interrupt(self, c: Container, channel: Channel, shell_pid: int, jobs_file: str) -> None:
        """Kill the processes the shell's current command started (the shell's descendants minus the
        background jobs listed, by their in-container pids, in ``jobs_file``) and send the shell SIGUSR1."""

    @abstractmethod
    def end_shell(self, c: Container, channel: Channel, shell_pid: int) -> None:
        """Kill a shell that no longer answers (the caller opens a new one)."""

    @abstractmethod
    def state(self, c: Container) -> ContainerState:
        """Is the container still there to run commands in; if not, was it the agent?"""

    @abstractmethod
    def seal(self, c: Container) -> None:
        """Stop every process of the container, whatever its uid, and verify none is left
        (ContainerError otherwise). The filesystem stays as the agent left it."""

    @abstractmethod
    def changes(self, c: Container) -> list[str]:
        """Absolute paths the container added, changed or deleted against its image."""

    @abstractmethod
    def disk_used(self, c: Container) -> int | None:
        """Bytes the container's writable layer holds (None where the runtime cannot tell)."""

    @abstractmethod
    def verify(self, c: Container, tests_dir: Path, argv: list[str], *, user: str, env: dict[str, str],
               timeout: float) -> VerifierRun:  # fmt: skip
        """After ``seal``: run ``argv`` on the container's final filesystem with ``tests_dir`` at /tests
        (root-owned, read-only) and a fresh /logs/verifier (writable by ``user`` only), nothing of the
        agent running; returns what /logs/verifier holds afterwards."""

    @abstractmethod
    def copy_in(self, c: Container, src: Path, dest_name: str) -> None:
        """Copy a host folder to ``/<dest_name>`` (root-owned, world-readable)."""

    @abstractmethod
    def destroy(self, c: Container) -> None:
        """Remove the container and everything of it (processes, writable layer); idempotent."""

    @abstractmethod
    def reap(self, run_id: str | None = None) -> int:
        """Remove containers of dead owners on this host (or, with ``run_id``, every one of that run)."""

    def close(self) -> None:
        """Release the runtime's own resources (clients); containers are the pool's to remove."""
