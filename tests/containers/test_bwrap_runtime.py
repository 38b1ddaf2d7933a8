"""The bwrap runtime's own promises, beyond the isolation and grading suites (tests/tasks): shells survive
the thread that opened them (a warm pool opens them in short-lived threads), and every limit it claims
here holds."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
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


NON_ROOT = r"""
import sys, types
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from verl_agent.containers import LABEL, OWNER_LABEL, RUN_LABEL, ContainerSpec, owner_id
from verl_agent.containers.bwrap import BwrapRuntime
from verl_agent.containers.images import RootfsImage
img = RootfsImage(ref="x", rootfs=Path(sys.argv[2]), user="", workdir="/", env={"PATH": "/usr/local/bin:/usr/bin:/bin"})
rt = BwrapRuntime(types.SimpleNamespace(get=lambda r: img, root=sys.argv[3]), state_dir=Path(sys.argv[3]),
                  bwrap=sys.argv[4])
c = rt.start(ContainerSpec("x", "1000", 1, 256, 64, 64), {LABEL: "1", RUN_LABEL: "r", OWNER_LABEL: owner_id()})
ch = rt.open_shell(c, {})
ch.sock.sendall(b"id -u; echo hi > /tmp/f; tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '; echo END\n")
out = b""
while b"END" not in out:
    out += ch.sock.recv(65536)
rt.seal(c)
tests = Path(sys.argv[3]) / "t"
tests.mkdir()
(tests / "test.sh").write_text("echo 1 > /logs/verifier/reward.txt\n")
run = rt.verify(c, tests, ["/bin/bash", "/tests/test.sh"], user="0", env={}, timeout=30)
print(out.decode().split(), rt.limits()["user"], rt.changes(c), run.files, flush=True)
rt.destroy(c)
"""


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/python3"),
                    reason="needs root to become another user, and the system's python3")
async def test_without_root_one_uid_is_mapped_and_the_runtime_still_works(pool, task):
    """A Slurm job: no root, so a user namespace maps this user to the agent's uid (every file is the
    agent's, as documented); shells, the seal, the changes and the verifier all work."""
    rootfs = pool.runtime.images.get(await pool.image_for(task)).rootfs
    tmp_path = Path(tempfile.mkdtemp(prefix="verl-agent-nonroot-"))  # pytest's own tmp is root's alone
    try:
        _as_user_1000(pool, rootfs, tmp_path)
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)


def _as_user_1000(pool, rootfs: Path, tmp_path: Path) -> None:
    mine = tmp_path / "rootfs"
    subprocess.run(["cp", "-a", str(rootfs), str(mine)], check=True)
    state = tmp_path / "state"
    state.mkdir()
    for path in (mine, state, tmp_path):
        subprocess.run(["chown", "-R", "1000:1000", str(path)], check=True)
    bwrap = pool.runtime.bwrap
    out = subprocess.run(["setpriv", "--reuid=1000", "--regid=1000", "--clear-groups", "/usr/bin/python3", "-c",
                          NON_ROOT, str(Path(__file__).resolve().parents[2]), str(mine), str(state), bwrap],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("['1000', 'lo', 'END'] one uid mapped")
    assert "'/tmp/f'" in out.stdout and "{'reward.txt': b'1\\n'}" in out.stdout
