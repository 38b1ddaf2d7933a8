"""Containers: the one layer every isolated environment of verl-agent is started through.

    runtime = get_runtime("auto")          # docker when a daemon answers, else bwrap
    c = runtime.start(spec, labels)        # then open_shell / interrupt / seal / changes / verify / destroy

``base.py`` says what a runtime offers (``Runtime``, ``ContainerSpec``, ``Container``, labels and owners);
``docker.py`` and ``bwrap.py`` are the two runtimes; ``images.py`` keeps unpacked root filesystems for
bwrap; ``cgroups.py`` makes limited control groups on cgroup v1 or v2. This package imports nothing
else of verl-agent: the Harbor tasks (``verl_agent.tasks``) and the sandbox build on it.
"""

from __future__ import annotations

from typing import Any

from verl_agent.containers.base import (
    AGENT_KILLED,
    CONTAINER_DEAD,
    LABEL,
    NODE_LABEL,
    OWNER_LABEL,
    ROOT_CAPS,
    RUN_LABEL,
    TASK_LABEL,
    Channel,
    Container,
    ContainerError,
    ContainerSpec,
    ContainerState,
    Runtime,
    VerifierRun,
    is_root,
    owner_alive,
    owner_id,
)

__all__ = ["AGENT_KILLED", "CONTAINER_DEAD", "LABEL", "NODE_LABEL", "OWNER_LABEL", "ROOT_CAPS", "RUNTIMES",
           "RUN_LABEL", "TASK_LABEL", "Channel", "Container", "ContainerError", "ContainerSpec", "ContainerState",
           "Runtime", "VerifierRun", "get_runtime", "is_root", "owner_alive", "owner_id"]

RUNTIMES = ("docker", "bwrap", "auto")


def get_runtime(name: str = "auto", **options: Any) -> Runtime:
    """A runtime by name: ``docker``, ``bwrap``, or ``auto`` (Docker when a daemon answers, else bwrap).
    ``options`` go to the runtime (docker: ``client``; bwrap: ``images``, ``state_dir``)."""
    if name not in RUNTIMES:
        raise ValueError(f"container runtime must be one of {', '.join(RUNTIMES)}; got {name!r}")
    if name == "auto":
        from verl_agent.containers.docker import daemon_answers

        name = "docker" if options.get("client") is not None or daemon_answers() else "bwrap"
    if name == "docker":
        from verl_agent.containers.docker import DockerRuntime

        return DockerRuntime(options.get("client"))
    from verl_agent.containers.bwrap import BwrapRuntime

    return BwrapRuntime(options.get("images"), state_dir=options.get("state_dir"))
