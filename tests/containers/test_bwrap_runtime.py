"""The bwrap runtime's own promises, beyond the isolation and grading suites (tests/tasks): shells survive
the thread that opened them (a warm pool opens them in short-lived threads), and every limit it claims
here holds."""

from __future__ import annotations

import asyncio
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tasks"))
from task_helpers import SLIM_DOCKERFILE, make_task, needs_docker  # noqa: E402

from verl_agent.containers.cgroups import available  # noqa: E402
from verl_agent.data.harbor import load_task  # noqa: E402
from verl_agent.tasks.pool import ContainerPool  # noqa: E402

pytestmark = [needs_docker, pytest.mark.docker]  # the image is exported from the local daemon


@pytest.fixture(scope="module")
def pool():
    p = ContainerPool("bwrap", warm=0)
    yield p
    p.close_sync()


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return load_task(make_task(tmp_path_factory.mktemp("bwrap"), "slim", dockerfile=SLIM_DOCKERFILE))


async def test_a_shell_outlives_the_thread_that_opened_it(pool, task):
    spec = pool.spec_for(task, await pool.image_for(task))
    boxes = []
    t = threading.Thread(target=lambda: boxes.append(pool._start(spec, task.name)))
    t.start()
    t.join()
    await asyncio.sleep(0.3)  # a parent-death signal would have landed by now
    box = boxes[0]
    try:
        assert box.shell.alive() and (await box.shell.run("echo ok")).output == "ok\n"
    finally:
        await pool.release(box)


@pytest.mark.skipif(available() is None, reason="no writable cgroup hierarchy here: only rlimits apply")
async def test_memory_and_pids_limits_are_the_specs(pool, task):
    box = await pool.acquire(task)
    try:
        group = pool.runtime._groups[box.id]
        limits = {p.parent.parent.name if group.version == "v1" else "v2": p for p in group.paths}
        if group.version == "v1":
            assert int((limits["memory"] / "memory.limit_in_bytes").read_text()) == task.config.memory_mb << 20
            assert int((limits["pids"] / "pids.max").read_text()) == box.spec.pids
        else:
            assert int((limits["v2"] / "memory.max").read_text()) == task.config.memory_mb << 20
        shell_pid = (await box.shell.run("echo $$")).output.strip()
        assert shell_pid and group.pids()  # the shell's processes sit in the groups
    finally:
        await pool.release(box)
