"""One task container: its isolation, its labels, and the reaper that removes what a dead run left.

``container_kwargs(spec)`` is the Docker SDK ``containers.create`` call every trajectory container is
made with, in one place:

* no network (``network_disabled`` + ``network_mode=none``: only loopback) unless the task asks for
  internet AND the caller allowed it;
* ``cap_drop ALL`` (a root agent keeps only CHOWN, DAC_OVERRIDE, FOWNER, FSETID, SETUID, SETGID, so
  package-style file work still runs), ``no-new-privileges``, private IPC, no Docker socket and no
  host path mounted;
* memory (swap included), CPU, pids and file-size limits from task.toml (``storage_mb`` also becomes
  the writable layer's size where the storage driver supports it);
* the user: ``[agent] user`` from task.toml, else the image's own USER (Harbor's convention);
* PID 1 is Docker's init reaping a ``sleep`` (the image's ENTRYPOINT/CMD do not run) whose length
  bounds the container's life: a container outlives neither its lifetime nor (``auto_remove``) its
  stop, even when nobody is left to remove it.

Labels: ``verl-agent.tasks=1``, the run id, the owner (``host:pid:process start time``) and the Ray
node. ``reap()`` removes every labelled container whose owner process is dead on this host (a crash
or ``kill -9`` of the trainer, or a daemon restart that left stopped ones), never a live run's.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from typing import Any

__all__ = ["LABEL", "ContainerSpec", "container_kwargs", "owner_id", "owner_alive", "reap"]

logger = logging.getLogger(__name__)

LABEL = "verl-agent.tasks"
RUN_LABEL, OWNER_LABEL, NODE_LABEL, TASK_LABEL = (f"{LABEL}.run", f"{LABEL}.owner", f"{LABEL}.node",
                                                  f"{LABEL}.task")
ROOT_CAPS = ["CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "SETUID", "SETGID"]


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



def is_root(user: str) -> bool:
    """Does `user` (Docker's "name", "uid" or "uid:gid"; "" = root) name root?"""
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


def container_kwargs(spec: ContainerSpec, labels: dict[str, str], image_user: str = "",
                     storage_opt: bool = False) -> dict[str, Any]:  # fmt: skip
    """Keyword arguments of ``client.containers.create`` for one trajectory container."""
    from docker.types import Ulimit

    user = spec.user or image_user
    root = is_root(user)
    fsize = spec.storage_mb << 20
    kw: dict[str, Any] = dict(
        image=spec.image, entrypoint=["sleep"], command=[str(int(spec.lifetime_s))], init=True, detach=True,
        auto_remove=True,
        user=user or None, hostname="task", labels=labels, stdin_open=False, tty=False,
        cap_drop=["ALL"], cap_add=ROOT_CAPS if root else None, security_opt=["no-new-privileges"],
        ipc_mode="private", mem_limit=f"{spec.memory_mb}m", memswap_limit=f"{spec.memory_mb}m",
        pids_limit=spec.pids, nano_cpus=int(spec.cpus * 1e9), log_config={"type": "none", "config": {}},
        ulimits=[Ulimit(name="fsize", soft=fsize, hard=fsize), Ulimit(name="core", soft=0, hard=0),
                 Ulimit(name="nofile", soft=4096, hard=4096)],
    )
    if spec.network:
        kw["network_mode"] = "bridge"
    else:
        kw["network_disabled"], kw["network_mode"] = True, "none"
    if storage_opt:
        kw["storage_opt"] = {"size": f"{spec.storage_mb}M"}
    return kw


def reap(client: Any, *, run_id: str | None = None) -> int:
    """Remove task containers of dead owners on this host (or, with ``run_id``, every one of that run).

    Containers of live runs, and of owners on other hosts (a shared remote daemon), are left alone;
    those end on their own when their lifetime runs out. Returns how many were removed."""
    import docker.errors

    filters = {"label": [f"{LABEL}=1"] + ([f"{RUN_LABEL}={run_id}"] if run_id else [])}
    removed = 0
    try:
        found = client.containers.list(all=True, filters=filters, ignore_removed=True)
    except docker.errors.APIError as e:
        logger.warning("task container reaper: listing failed: %s", e)
        return 0
    for c in found:
        owner = c.labels.get(OWNER_LABEL, "")
        if run_id is None and owner_alive(owner) is not False:
            continue
        try:
            c.remove(force=True)
            removed += 1
        except docker.errors.NotFound:
            removed += 1  # auto-removed meanwhile
        except docker.errors.APIError as e:
            if "already in progress" not in str(e):
                logger.warning("task container reaper: removing %s failed: %s", c.short_id, e)
    if removed:
        logger.info("task container reaper: removed %d container(s)%s", removed,
                    f" of run {run_id}" if run_id else " of dead runs")
    return removed
