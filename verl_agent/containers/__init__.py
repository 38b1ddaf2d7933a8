"""Containers: the one layer every isolated environment of verl-agent is started through.

    runtime = get_runtime("auto")          # docker when a daemon answers, else bwrap
    c = runtime.start(spec, labels)        # then open_shell / interrupt / seal / changes / verify / destroy

``base.py`` says what a runtime offers (``Runtime``, ``ContainerSpec``, ``Container``, labels and owners);
``docker.py`` and ``bwrap.py`` are the two runtimes; ``images.py`` keeps unpacked root filesystems for
bwrap; ``cgroups.py`` makes limited control groups on cgroup v1 or v2. This package imports nothing
else of verl-agent but the registry (``CONTAINER_RUNTIMES``: a user's own runtime registers there and is
then a valid ``runtime``): the Harbor tasks (``verl_agent.tasks``) and the sandbox build on it.
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
from verl_agent.registry import CONTAINER_RUNTIMES

__all__ = ["AGENT_KILLED", "CONTAINER_DEAD", "LABEL", "NODE_LABEL", "OWNER_LABEL", "ROOT_CAPS",
           "RUN_LABEL", "TASK_LABEL", "Channel", "Container", "ContainerError", "ContainerSpec", "ContainerState",
           "Runtime", "VerifierRun", "get_runtime", "runtime_names", "is_root", "owner_alive", "owner_id"]



@CONTAINER_RUNTIMES.register("docker")
def _docker(client: Any = None, **_: Any) -> Runtime:
    from verl_agent.containers.docker import DockerRuntime

    return DockerRuntime(client)


@CONTAINER_RUNTIMES.register("bwrap")
def _bwrap(images: Any = None, state_dir: Any = None, **_: Any) -> Runtime:
    from verl_agent.containers.bwrap import BwrapRuntime

    return BwrapRuntime(images, state_dir=state_dir)


def runtime_names() -> list[str]:
    """What a ``runtime`` setting accepts: the registered runtimes and ``auto``."""
    return [*CONTAINER_RUNTIMES.names(), "auto"]


def get_runtime(name: str = "auto", **options: Any) -> Runtime:
    """A runtime by its registered name (``docker``, ``bwrap``, a user's own), or ``auto``: Docker when a
    daemon answers, else bwrap. ``options`` go to the runtime's factory (docker: ``client``; bwrap:
    ``images``, ``state_dir``)."""
    if name == "auto":
        from verl_agent.containers.docker import daemon_answers

        name = "docker" if options.get("client") is not None or daemon_answers() else "bwrap"
    return CONTAINER_RUNTIMES.get(name)(**options)
