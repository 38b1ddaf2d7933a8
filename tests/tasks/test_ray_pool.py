"""Scale across nodes: a local 2-node Ray cluster (two raylets on this machine), one pool actor per node
placed by node affinity, and trajectories on each node served by their own node's pool (its containers
labelled with that node id), graded with the task's tests."""

from __future__ import annotations

import os
import tempfile

import pytest
from task_helpers import needs_docker

pytestmark = [needs_docker, pytest.mark.docker, pytest.mark.slow]


def _trajectory(task_dir: str) -> dict:
    """One trajectory in a Ray task: the container tools' pool with `pool: ray`, as a rollout worker has it."""
    import asyncio

    import ray

    from verl_agent.tasks import env
    from verl_agent.tasks.grading import copy_in

    async def run() -> dict:
        e = await env.attach("traj-" + ray.get_runtime_context().get_task_id(), task_dir, pool="ray", warm=0)
        try:
            pwd = (await e.run("pwd", 10)).output
            await asyncio.to_thread(copy_in, e.pool.runtime, e.box, e.task.solution_dir, "solution")
            await e.run("bash /solution/solve.sh", 30)
            graded = await e.grade()
            return {"worker_node": ray.get_runtime_context().get_node_id(), "pool_node": e.pool.node_id,
                    "label_node": e.box.labels.get("verl-agent.tasks.node"), "reward": graded.reward, "pwd": pwd}
        finally:
            await env.detach("traj-" + ray.get_runtime_context().get_task_id())

    return asyncio.run(run())


def test_one_pool_per_node_serves_that_nodes_trajectories(count_task):
    os.environ.setdefault("RAY_TMPDIR", os.path.join(tempfile.gettempdir(), "ray"))
    import docker
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from verl_agent.tasks.ray_pool import ensure_node_pools

    import sys

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this test module
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    cluster.add_node(num_cpus=1)
    try:
        ray.init(address=cluster.address, runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}})
        cluster.wait_for_nodes()
        nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
        assert len(nodes) == 2
        traj = ray.remote(num_cpus=1)(_trajectory)  # the first trajectory of a node makes its pool actor
        refs = [traj.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n, soft=False)).remote(str(count_task))
                for n in nodes for _ in range(2)]
        results = ray.get(refs, timeout=180)
        for n, r in zip([n for n in nodes for _ in range(2)], results):
            assert r == {"worker_node": n, "pool_node": n, "label_node": n, "reward": 1.0, "pwd": "/app\n"}
        pools = ensure_node_pools(warm=0)  # the driver's call finds the same actors
        stats = ray.get([pools[n].info.remote() for n in nodes])
        assert [s["node_id"] for s in stats] == nodes  # each actor runs on the node it serves
        assert [s["stats"]["started"] for s in stats] == [2, 2] and [s["in_use"] for s in stats] == [0, 0]
        runs = [s["run_id"] for s in stats]
        ray.get([pools[n].close.remote() for n in nodes])
        client = docker.from_env()
        assert not [c for r in runs for c in client.containers.list(
            all=True, ignore_removed=True, filters={"label": f"verl-agent.tasks.run={r}"})]
    finally:
        ray.shutdown()
        cluster.shutdown()
