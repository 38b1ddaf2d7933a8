"""One container pool per Ray node: each node's trajectories use that node's Docker daemon.

    pools = ensure_node_pools(warm=2)     # optional, on the driver: one ContainerPoolActor per alive
                                          # node, pinned to it (NodeAffinitySchedulingStrategy, soft=False)
    # in a rollout worker (tool YAML: `pool: ray`): env.get_pool() is a NodePoolClient that asks the
    # actor of the worker's own node (ray.get_runtime_context().get_node_id()) for containers; the
    # first worker of a node that needs it makes it (get_if_exists), when the driver did not

Placement is Ray's: the rollout workers go where the trainer's placement puts them, and each finds
the pool actor of its node by name (``verl-agent-tasks-pool-<node id>``); there is no scheduler here.
The actor owns the containers (start, warm pool, labels with the node id, reaping, removal); the
worker opens the container's shell itself over its node's daemon socket, so command round trips
never pass through the actor. Each actor's containers carry its node id in ``verl-agent.tasks.node``.
A single pool against a remote daemon needs none of this: set ``DOCKER_HOST`` (``docker.from_env``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from verl_agent.containers import get_runtime
from verl_agent.data.harbor import HarborTask, load_task
from verl_agent.tasks.pool import ContainerPool, TaskContainer
from verl_agent.tasks.shell import Shell

__all__ = ["ContainerPoolActor", "NodePoolClient", "actor_name", "ensure_node_pools", "node_pool"]

PREFIX = "verl-agent-tasks-pool-"


def actor_name(node_id: str) -> str:
    return PREFIX + node_id


class ContainerPoolActor:
    """The pool of one node (run as a Ray actor pinned to it); hands out started containers by id."""

    def __init__(self, node_id: str, **options: Any) -> None:
        self.node_id = node_id
        self.pool = ContainerPool(options.pop("runtime", "auto"), node_id=node_id, shells=False, **options)
        self.boxes: dict[str, TaskContainer] = {}

    async def acquire(self, task_dir: str) -> dict[str, Any]:
        box = await self.pool.acquire(load_task(task_dir, allow_internet=None))
        self.boxes[box.id] = box
        return {"container": box.container, "started_s": box.started_s, "warm": box.warm}

    async def release(self, container_id: str) -> None:
        box = self.boxes.pop(container_id, None)
        if box is not None:
            await self.pool.release(box)

    def runtime_name(self) -> str:
        return self.pool.runtime.name

    def info(self) -> dict[str, Any]:
        import socket

        return {"node_id": self.node_id, "hostname": socket.gethostname(), "run_id": self.pool.run_id,
                "stats": dict(self.pool.stats), "in_use": len(self.boxes)}

    def close(self) -> None:
        self.pool.close_sync()


def node_pool(node_id: str, **options: Any) -> Any:
    """The pool actor of one node, made (pinned to that node) if it does not exist yet."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    remote = ray.remote(num_cpus=0, max_concurrency=256)(ContainerPoolActor)
    return remote.options(
        name=actor_name(node_id), get_if_exists=True,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
    ).remote(node_id, **options)


def ensure_node_pools(**options: Any) -> dict[str, Any]:
    """One ContainerPoolActor per alive Ray node (made once; later calls return the same actors)."""
    import ray

    actors = {n["NodeID"]: node_pool(n["NodeID"], **options) for n in ray.nodes() if n.get("Alive")}
    ray.get([a.info.remote() for a in actors.values()])  # started, each on its node
    return actors


class NodePoolClient:
    """A rollout worker's view of its node's pool actor, with ContainerPool's acquire/release."""

    def __init__(self, max_output: int = 16000, runtime: str = "auto", **options: Any) -> None:
        import ray

        self.node_id = ray.get_runtime_context().get_node_id()
        # the existing actor, if any; this process opens shells (and grades) through a runtime of the same kind
        self.actor = node_pool(self.node_id, max_output=max_output, runtime=runtime, **options)
        self.runtime = get_runtime(ray.get(self.actor.runtime_name.remote()))
        self.max_output = max_output

    async def acquire(self, task: HarborTask) -> TaskContainer:
        got = await self.actor.acquire.remote(str(task.path))
        c = got["container"]
        shell = Shell(self.runtime, c, max_output=self.max_output)
        try:
            await asyncio.to_thread(shell.open)
        except BaseException:
            await self.actor.release.remote(c.id)
            raise
        return TaskContainer(c, shell, got["started_s"], got["warm"], task.name)

    async def release(self, box: TaskContainer) -> None:
        box.shell.close()
        await self.actor.release.remote(box.id)

    def close_sync(self) -> None:
        """The node's actor owns the containers; nothing to do here."""
