"""Agents that try to forge their grade, on both runtimes: none of them solves the task (its honest grade is
0) and each must still end with 0. Each attack runs as a real trajectory would: commands in the agent's
persistent shell, then ``grading.grade``.

Each attack is also shown to work, so its test could fail: on Docker against the grading this project used
before (``legacy_grade``: one kill pass as the agent's user, ``/logs/verifier`` mode 777, ``bash`` found
through PATH), and where one guard alone stops it, against ``grade`` with that guard removed (the tamper
check). bwrap never had the old grading, and its verifier cannot share a PID namespace with the agent, so
its twins are the guard removals only."""

from __future__ import annotations

import asyncio
import contextlib
import tarfile
import time

import pytest
from task_helpers import SLIM_DOCKERFILE, make_task, needs_docker

from verl_agent.containers import AGENT_KILLED
from verl_agent.tasks import grading
from verl_agent.tasks.grading import DISK, TAMPERED, grade, read_reward
from verl_agent.tasks.pool import ContainerPool
from verl_agent.tasks.shell import ShellError
from verl_agent.data.harbor import load_task

pytestmark = [needs_docker, pytest.mark.docker]

ROOT_DOCKERFILE = SLIM_DOCKERFILE.replace("USER 10001", "USER root")

# A process under another uid that waits for the tests, then rewrites them and plants a reward.
OTHER_UID = r"""cat > /tmp/evil.sh <<'EOF'
while :; do
  if [ -d /tests ]; then
    printf '#!/bin/bash\nmkdir -p /logs/verifier; echo 1 > /logs/verifier/reward.txt\n' > /tests/test.sh 2>/dev/null
    mkdir -p /logs/verifier 2>/dev/null; echo 1 > /logs/verifier/reward.txt 2>/dev/null
  fi
  sleep 0.005
done
EOF
chmod 755 /tmp/evil.sh; setpriv --reuid=65534 --regid=65534 --clear-groups nohup bash /tmp/evil.sh >/dev/null 2>&1 &
sleep 0.2; ps -o user= -p $! 2>/dev/null || stat -c %U /proc/$!"""

# Replacements of what the verifier runs: through PATH, and the absolute /bin/bash itself.
TROJAN = r"""printf '#!/bin/sh\nmkdir -p /logs/verifier; echo 1 > /logs/verifier/reward.txt\n' > /tmp/trojan
chmod 755 /tmp/trojan; cp /tmp/trojan /usr/local/bin/bash; {extra} echo planted"""

# Chains that fork faster than a kill pass scans, each waiting for /tests to plant a reward.
FORK_CHAINS = r"""cat > /tmp/chain.sh <<'EOF'
[ -d /tests ] && { mkdir -p /logs/verifier; echo 1 > /logs/verifier/reward.txt; } 2>/dev/null
sleep 0.02
bash /tmp/chain.sh &
EOF
for i in $(seq 20); do setsid bash /tmp/chain.sh >/dev/null 2>&1 & done; sleep 0.3; echo started"""

PLANTED = r"""mkdir -p /logs/verifier /tests && echo 1 > /logs/verifier/reward.txt && chmod -R 777 /logs
printf '#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n' > /tests/test.sh; echo planted"""


@pytest.fixture(scope="module", params=["docker", "bwrap"])
def pool(request):
    p = ContainerPool(request.param, warm=0)
    yield p
    p.close_sync()


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    root = tmp_path_factory.mktemp("attacks")
    return {"user": load_task(make_task(root, "as-user", dockerfile=SLIM_DOCKERFILE, storage_mb=20,
                                        verifier_timeout=5.0)),
            "root": load_task(make_task(root, "as-root", dockerfile=ROOT_DOCKERFILE, storage_mb=20,
                                        verifier_timeout=5.0))}


async def _attack(pool: ContainerPool, task, commands: list[str], *, grader=grade):
    """The commands in the agent's shell (as ``TaskEnvironment.run``: a container the agent ended ends the
    episode), then the grade."""
    box = await pool.acquire(task)
    try:
        outputs = []
        for cmd in commands:
            try:
                outputs.append((await box.shell.run(cmd, 30)).output)
            except ShellError as e:
                assert e.cause == AGENT_KILLED, e
                outputs.append(f"[ended: {e}]")
                break
        return await asyncio.to_thread(grader, pool.runtime, box, task), outputs
    finally:
        await pool.release(box)


def legacy_grade(runtime, box, task):
    """The grading before the container layer (Docker only): one kill pass as the agent's user, a
    world-writable /logs/verifier, ``bash`` through PATH in the agent's own container."""
    c = box.container
    box.shell.close()
    kill_pass = ("keep=\" 1 $$ $(cat /proc/1/task/1/children) \"; for d in /proc/[0-9]*; do p=${d#/proc/}; "
                 "case $keep in *\" $p \"*) ;; *) kill -9 $p 2>/dev/null;; esac; done")
    runtime.exec(c, ["sh", "-c", kill_pass], user=c.user, timeout=30)
    runtime.exec(c, ["sh", "-c", "mv /tests /tests.old; mv /logs /logs.old; mkdir -p /logs/verifier && "
                     "chmod 777 /logs /logs/verifier"], user="0", timeout=30)
    runtime.copy_in(c, task.tests_dir, "tests")
    time.sleep(0.3)  # what a verifier takes to start: the time an attacker has
    runtime.exec(c, ["bash", "/tests/test.sh"], user="0", workdir=c.workdir, timeout=30)
    time.sleep(0.3)  # what reading the reward takes: more time for anything still running
    text = None
    for _ in range(20):  # a read can land between an attacker's truncate and its write, or inside the write
        with contextlib.suppress(tarfile.ReadError):  # the file shrank while docker archived it
            text = runtime._read_file(c, "/logs/verifier/reward.txt")
        if text:
            break
        time.sleep(0.02)
    return grading.Grade(*read_reward({"reward.txt": text or b"nan"}))


def _no_tamper_check(monkeypatch) -> None:
    monkeypatch.setattr(grading, "tampered", lambda paths: [])


async def test_a_process_under_another_uid_cannot_touch_the_tests(pool, tasks):
    graded, out = await _attack(pool, tasks["root"], [OTHER_UID])
    assert "nobody" in out[0] or "65534" in out[0]  # it ran under another uid
    assert graded.reward == 0.0 and not graded.forfeit
    if pool.runtime.name == "docker":
        old, _ = await _attack(pool, tasks["root"], [OTHER_UID], grader=legacy_grade)
        assert old.reward == 1.0


@pytest.mark.parametrize("target", ["path", "bin_bash"])
async def test_a_trojan_of_what_the_verifier_runs_forfeits(pool, tasks, target, monkeypatch):
    extra = "mv /tmp/trojan.abs /bin/bash;" if target == "bin_bash" else ""
    cmd = TROJAN.format(extra=extra).replace("cp /tmp/trojan /usr", "cp /tmp/trojan /tmp/trojan.abs; cp /tmp/trojan /usr")
    graded, out = await _attack(pool, tasks["root"], [cmd])
    assert out[0].strip().endswith("planted")
    assert (graded.reward, graded.forfeit) == (0.0, TAMPERED) and "/usr/local/bin/bash" in graded.output
    if target == "bin_bash":  # the absolute path alone does not help once /bin/bash itself is replaced
        _no_tamper_check(monkeypatch)
        twin, _ = await _attack(pool, tasks["root"], [cmd])
        assert twin.reward == 1.0
    elif pool.runtime.name == "docker":  # PATH finds /usr/local/bin first
        old, _ = await _attack(pool, tasks["root"], [cmd], grader=legacy_grade)
        assert old.reward == 1.0


async def test_fork_chains_of_a_non_root_agent_are_all_gone_before_grading(pool, tasks):
    graded, out = await _attack(pool, tasks["user"], [FORK_CHAINS])
    assert out[0].strip().endswith("started")
    assert graded.reward == 0.0 and not graded.forfeit
    if pool.runtime.name == "docker":
        old, _ = await _attack(pool, tasks["user"], [FORK_CHAINS], grader=legacy_grade)
        assert old.reward == 1.0


async def test_a_planted_reward_and_planted_tests_are_ignored(pool, tasks):
    graded, out = await _attack(pool, tasks["root"], [PLANTED])
    assert out[0].strip().endswith("planted")
    assert graded.reward == 0.0 and not graded.forfeit


@pytest.mark.parametrize("target", ["/proc/1/fd", "/dev/null", "/app"])
async def test_symlinked_tests_and_logs_cannot_derail_grading(pool, tasks, target):
    """A grading that fails is an infrastructure failure, kept out of the loss: the agent must not be able
    to cause one with what it leaves at /tests or /logs."""
    graded, _ = await _attack(pool, tasks["root"], [f"ln -sfn {target} /logs; ln -sfn {target} /tests; echo done"])
    assert graded.reward == 0.0 and not graded.forfeit


async def test_a_fifo_the_verifier_reads_is_the_agents_zero(pool, tasks):
    """The verifier hangs on a FIFO the agent left where the answer belongs: a forfeit, not an infrastructure
    failure that would drop the trajectory from the loss."""
    graded, _ = await _attack(pool, tasks["user"], ["mkfifo /app/count.txt && echo made"])
    assert (graded.reward, graded.forfeit) == (0.0, "agent_verifier_timeout")


async def test_killing_init_is_refused_to_a_non_root_agent(pool, tasks):
    """No infrastructure failure to hide behind: init ignores the agent, the grade is the honest 0."""
    graded, out = await _attack(pool, tasks["user"], ["kill -TERM 1; kill -9 1; echo rc=$?", "echo alive"])
    assert out[1].strip() == "alive"
    assert graded.reward == 0.0 and not graded.forfeit


async def test_a_root_agent_that_ends_its_container_forfeits(pool, tasks):
    """Docker: killing PID 1's keeper stops the container, charged to the agent. bwrap: the container is
    its layer on disk; killing every process only restarts the shell, and the grade is the honest 0."""
    kill = "kill -9 $(cat /proc/1/task/1/children) 2>/dev/null; kill -9 -1; sleep 1; echo after"
    graded, _ = await _attack(pool, tasks["root"], [kill, "echo more"])
    assert graded.reward == 0.0
    assert graded.forfeit == ("agent_killed_container" if pool.runtime.name == "docker" else "")


async def test_the_disk_cap_is_total_not_per_file(pool, tasks):
    """Eight 15 MB files with storage_mb = 20: the per-file limit lets each through; the total does not."""
    fill = "for i in 1 2 3 4 5 6 7 8; do head -c 15M /dev/zero > /tmp/f$i 2>/dev/null; done; du -sm /tmp | cut -f1"
    graded, out = await _attack(pool, tasks["user"], [fill])
    assert graded.reward == 0.0
    if pool.runtime.name == "bwrap":  # a tmpfs of storage_mb: the writes themselves stop
        assert int(out[0].split()[-1]) <= 21 and not graded.forfeit
    else:  # Docker without a quota-capable driver: counted after the episode
        assert int(out[0].split()[-1]) >= 100 and graded.forfeit == DISK


async def test_changes_read_from_the_upper_layer_are_the_daemons_diff(pool, tasks):
    """Docker: the tamper check walks the overlay's upper layer from this host; it lists what ``docker
    diff`` lists (added, changed and deleted paths) at a fraction of the time."""
    if pool.runtime.name != "docker":
        pytest.skip("the daemon's diff exists on Docker only")
    box = await pool.acquire(tasks["root"])
    try:
        await box.shell.run("echo x > /usr/local/bin/new; rm -f /etc/debian_version; mkdir -p /opt/a/b; echo y > /opt/a/b/f")
        box.shell.close()
        c, api = box.container, pool.runtime.client.api
        daemon = {d["Path"] for d in api.diff(c.id)} - {"/tmp", "/tmp/.verl_agent_jobs"}
        ours = set(pool.runtime.changes(c)) - {"/tmp", "/tmp/.verl_agent_jobs"}
        assert {"/usr/local/bin/new", "/etc/debian_version", "/opt/a/b/f"} <= ours and ours == daemon
    finally:
        await pool.release(box)
