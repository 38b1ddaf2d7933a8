"""No container is left behind: after a trainer killed with SIGKILL (reaped by the next pool's start, or by
a live pool's timer), and when nobody is left at all (the container's own lifetime ends it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from task_helpers import needs_docker

from verl_agent.tasks.container import LABEL, OWNER_LABEL
from verl_agent.tasks.pool import ContainerPool
from verl_agent.data.harbor import load_task

pytestmark = [needs_docker, pytest.mark.docker]

CHILD = """
import asyncio, sys
from verl_agent.tasks.pool import ContainerPool
from verl_agent.data.harbor import load_task

async def main():
    pool = ContainerPool(warm=1)
    task = load_task(sys.argv[1])
    boxes = [await pool.acquire(task), await pool.acquire(task)]  # two in use, one warm being started
    print(pool.owner, flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


def _kill_a_trainer(task_dir) -> str:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(task_dir)], stdout=subprocess.PIPE, text=True,
                            env=env)
    owner = proc.stdout.readline().strip()
    time.sleep(0.5)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return owner


def _of(client, owner: str) -> list:
    return client.containers.list(all=True, ignore_removed=True,
                                  filters={"label": [f"{LABEL}=1", f"{OWNER_LABEL}={owner}"]})


def test_containers_of_a_killed_trainer_are_reaped_at_the_next_start_and_by_the_timer(count_task):
    owner = _kill_a_trainer(count_task)
    import docker

    client = docker.from_env()
    assert len(_of(client, owner)) >= 2  # left behind by the SIGKILL
    pool = ContainerPool(warm=0)  # the next start (another live pool on this host may have reaped them first)
    try:
        assert not _of(client, owner)
    finally:
        pool.close_sync()
    watcher = ContainerPool(warm=0, reap_interval_s=0.5)  # a live pool reaps on its timer
    try:
        owner = _kill_a_trainer(count_task)
        deadline = time.monotonic() + 15
        while _of(client, owner) and time.monotonic() < deadline:
            time.sleep(0.25)
        assert not _of(client, owner)
    finally:
        watcher.close_sync()


async def test_a_container_ends_with_its_lifetime_even_when_nobody_removes_it(count_task):
    pool = ContainerPool(warm=0, lifetime_s=1)
    try:
        box = await pool.acquire(load_task(count_task))
        box.shell.close()
        deadline = time.monotonic() + 20

        def gone() -> bool:
            return not pool.client.containers.list(all=True, ignore_removed=True, filters={"id": box.id})

        while not gone() and time.monotonic() < deadline:
            time.sleep(0.25)
        assert gone()  # auto-removed on its own
    finally:
        pool.close_sync()


async def test_warm_containers_of_an_idle_image_are_removed(count_task):
    pool = ContainerPool(warm=2, idle_s=2.0)
    try:
        task = load_task(count_task)
        await pool.prewarm(task)
        assert pool.ready_count() == 2
        deadline = time.monotonic() + 15
        while pool.ready_count() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert pool.ready_count() == 0 and pool.stats["evicted"] == 2
    finally:
        pool.close_sync()
    mine = {"label": f"verl-agent.tasks.run={pool.run_id}"}
    assert not pool.client.containers.list(all=True, ignore_removed=True, filters=mine)


def test_reap_removes_only_dead_owners_containers_running_or_stopped(count_task):
    """After a daemon restart a dead run's containers may be stopped, not running: both kinds go; a live
    owner's and another host's stay."""
    import socket

    import docker

    from verl_agent.tasks.container import RUN_LABEL, owner_id, reap
    from verl_agent.tasks.image import ensure_image

    client = docker.from_env()
    image = ensure_image(load_task(count_task), client)
    run = f"reap-{os.getpid()}"
    owners = {"dead": f"{socket.gethostname()}:{2**22 + 7}:1", "live": owner_id(), "elsewhere": "other-host:1:1"}
    made = {}
    for kind, owner in owners.items():
        c = client.containers.create(image, ["sleep", "60"], labels={LABEL: "1", RUN_LABEL: run, OWNER_LABEL: owner})
        made[kind] = c  # created, never started: what a stopped container looks like to the reaper
    running_dead = client.containers.run(image, ["sleep", "60"], detach=True, network_disabled=True,
                                         labels={LABEL: "1", RUN_LABEL: run, OWNER_LABEL: owners["dead"]})
    try:
        reap(client)
        mine = {"label": f"{RUN_LABEL}={run}"}
        left = {c.id for c in client.containers.list(all=True, ignore_removed=True, filters=mine)}
        assert made["dead"].id not in left and running_dead.id not in left
        assert made["live"].id in left and made["elsewhere"].id in left
        assert reap(client, run_id=run) == 2  # a run's own sweep takes the rest
    finally:
        for c in client.containers.list(all=True, ignore_removed=True, filters={"label": f"{RUN_LABEL}={run}"}):
            c.remove(force=True)


async def test_a_warm_container_that_died_is_replaced_not_handed_out(count_task):
    """What a daemon restart does to a warm pool (every warm container stops, its shell's stream ends), done
    to one container with `docker kill`: acquire skips it, removes it, and starts a working one."""
    pool = ContainerPool(warm=1)
    try:
        task = load_task(count_task)
        await pool.prewarm(task)
        (dead,) = [b for q in pool._ready.values() for b in q]
        pool.client.containers.get(dead.id).kill()
        deadline = time.monotonic() + 10
        while dead.shell.alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        box = await pool.acquire(task)
        assert box.id != dead.id and pool.stats["warm_dead"] == 1 and box.shell.alive()
        assert (await box.shell.run("echo ok")).output.strip() == "ok"
        await pool.release(box)
    finally:
        pool.close_sync()
    mine = {"label": f"verl-agent.tasks.run={pool.run_id}"}
    assert not pool.client.containers.list(all=True, ignore_removed=True, filters=mine)
