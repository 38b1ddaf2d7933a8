"""No container is left behind: after a trainer killed with SIGKILL (Docker: reaped by the next pool's start,
or by a live pool's timer; bwrap: at once by the runtime's janitor, no process, mount, directory or cgroup
left), and when nobody is left at all (a Docker container's own lifetime stops it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from task_helpers import SLIM_DOCKERFILE, make_task, needs_docker

from verl_agent.containers import LABEL, OWNER_LABEL
from verl_agent.tasks.pool import ContainerPool
from verl_agent.data.harbor import load_task

pytestmark = [needs_docker, pytest.mark.docker]

CHILD = """
import asyncio, sys
from verl_agent.tasks.pool import ContainerPool
from verl_agent.data.harbor import load_task

async def main():
    pool = ContainerPool(sys.argv[2], warm=1)
    task = load_task(sys.argv[1])
    boxes = [await pool.acquire(task), await pool.acquire(task)]  # two in use, one warm being started
    for b in boxes:
        await b.shell.run("sleep 600 &")
    print(pool.owner, *[b.container.handle.get("home", "") for b in boxes], flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


def _kill_a_trainer(task_dir, runtime: str = "docker") -> str:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(task_dir), runtime], stdout=subprocess.PIPE,
                            text=True, env=env)
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
    pool = ContainerPool("docker", warm=0)  # the next start (another live pool on this host may have reaped them first)
    try:
        assert not _of(client, owner)
    finally:
        pool.close_sync()
    watcher = ContainerPool("docker", warm=0, reap_interval_s=0.5)  # a live pool reaps on its timer
    try:
        owner = _kill_a_trainer(count_task)
        deadline = time.monotonic() + 15
        while _of(client, owner) and time.monotonic() < deadline:
            time.sleep(0.25)
        assert not _of(client, owner)
    finally:
        watcher.close_sync()


async def test_a_container_stops_with_its_lifetime_even_when_nobody_removes_it(count_task):
    """Stopped, it runs nothing (the reaper removes it once its owner is dead); its exit says the lifetime
    ended, not the agent."""
    pool = ContainerPool("docker", warm=0, lifetime_s=1)
    try:
        box = await pool.acquire(load_task(count_task))
        box.shell.close()
        deadline = time.monotonic() + 20

        def stopped() -> bool:
            return not pool.runtime.client.containers.list(ignore_removed=True, filters={"id": box.id})

        while not stopped() and time.monotonic() < deadline:
            time.sleep(0.25)
        assert stopped()
        state = pool.runtime.state(box.container)
        assert (state.running, state.cause) == (False, "container_dead")
    finally:
        pool.close_sync()


async def test_warm_containers_of_an_idle_image_are_removed(count_task):
    pool = ContainerPool("docker", warm=2, idle_s=2.0)
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
    assert not pool.runtime.client.containers.list(all=True, ignore_removed=True, filters=mine)


def test_reap_removes_only_dead_owners_containers_running_or_stopped(count_task):
    """After a daemon restart a dead run's containers may be stopped, not running: both kinds go; a live
    owner's and another host's stay."""
    import socket

    import docker

    from verl_agent.containers import RUN_LABEL, owner_id
    from verl_agent.containers.docker import reap
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
    pool = ContainerPool("docker", warm=1)
    try:
        task = load_task(count_task)
        await pool.prewarm(task)
        (dead,) = [b for q in pool._ready.values() for b in q]
        pool.runtime.client.containers.get(dead.id).kill()
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
    assert not pool.runtime.client.containers.list(all=True, ignore_removed=True, filters=mine)


def test_bwrap_leaves_nothing_after_a_trainer_killed_with_sigkill(tmp_path):
    """Two containers in use (each with a background job) and one warm: after the SIGKILL no process of
    theirs, no mount, no directory and no control group is left, with no other pool started."""
    from verl_agent.containers.bwrap import _cgroup_paths

    task_dir = make_task(tmp_path, "slim", dockerfile=SLIM_DOCKERFILE)
    ContainerPool("bwrap", warm=0).close_sync()  # the image exported beforehand, not under the child's clock
    fields = _kill_a_trainer(task_dir, "bwrap").split()
    homes = fields[1:]
    assert len(homes) == 2 and all(homes)
    deadline = time.monotonic() + 10

    def left() -> list[str]:
        found = [h for h in homes if os.path.exists(h)]
        found += [line for line in open("/proc/mounts") if any(h in line for h in homes)]
        found += [str(p) for h in homes for p in _cgroup_paths(os.path.basename(h)) if p.exists()]
        found += [pid for pid in os.listdir("/proc") if pid.isdigit() and _runs_in(pid, homes)]
        return found

    while left() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert left() == []


def _runs_in(pid: str, homes: list[str]) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().decode(errors="replace")
    except OSError:
        return False
    return any(h in cmd for h in homes)
