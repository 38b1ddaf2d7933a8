"""The persistent bash of a trajectory: state persists, a timeout kills only its command, output is capped
with a marker, the exit code is reported, and a broken command never hangs the shell."""

from __future__ import annotations

import time

import pytest
from task_helpers import needs_docker

from verl_agent.tasks.shell import ansi_c_quote, cap_output
from verl_agent.data.harbor import load_task

pytestmark = [needs_docker, pytest.mark.docker]


@pytest.fixture
async def box(pool, count_task):
    b = await pool.acquire(load_task(count_task))
    yield b
    await pool.release(b)


async def test_cwd_env_functions_and_background_jobs_persist(box):
    sh = box.shell
    assert (await sh.run("pwd")).output == "/app\n"  # the image's WORKDIR
    assert (await sh.run("cd /tmp && export GREETING=hi && f() { echo \"f:$1\"; }")).exit_code == 0
    res = await sh.run("pwd; echo $GREETING; f x")
    assert res.output == "/tmp\nhi\nf:x\n" and res.exit_code == 0
    await sh.run("sleep 30 & echo $! > /tmp/bg.pid")
    res = await sh.run("kill -0 $(cat /tmp/bg.pid) && echo alive; jobs | wc -l")
    assert res.output == "alive\n1\n"


async def test_exit_code_stderr_and_quoting(box):
    sh = box.shell
    res = await sh.run("echo out; echo err >&2; exit_code() { return 7; }; exit_code")
    assert (res.output, res.exit_code) == ("out\nerr\n", 7)
    tricky = "printf '%s|' \"a b\" 'c'\\''d' $'tab\\there' \"$(printf '\\036')\" && echo"
    assert (await sh.run(tricky)).output == "a b|c'd|tab\there|\x1e|\n"
    res = await sh.run("echo 'unbalanced")  # a syntax error of this call, not a hung shell
    assert res.exit_code == 2 and "unexpected EOF" in res.output
    assert (await sh.run("read x; echo \"got:$x\"")).output == "got:\n"  # stdin is /dev/null, not the protocol
    assert (await sh.run("echo still here")).output == "still here\n"


async def test_timeout_kills_only_the_command(box):
    sh = box.shell
    await sh.run("cd /tmp; export KEEP=1; sleep 60 & echo started")
    t0 = time.perf_counter()
    res = await sh.run("echo before; sleep 30; echo never", timeout=1.0)
    assert res.timed_out and res.exit_code == 137 and not res.restarted
    assert res.output.startswith("before\n") and "never" not in res.output and time.perf_counter() - t0 < 8
    after = await sh.run("pwd; echo $KEEP; jobs -r | wc -l")  # same shell: cwd, env and the earlier job survive
    assert after.output == "/tmp\n1\n1\n" and not after.timed_out


async def test_timeout_ends_a_builtin_loop_and_a_stubborn_shell_is_replaced(box):
    res = await box.shell.run("cd /tmp; while :; do :; done", timeout=1.0)
    assert res.timed_out and not res.restarted and res.exit_code == 137
    assert (await box.shell.run("pwd")).output == "/tmp\n"  # the same shell
    res = await box.shell.run("trap '' USR1; while :; do :; done", timeout=1.0)  # ignores the interrupt
    assert res.timed_out and res.restarted and res.exit_code == 137
    assert (await box.shell.run("pwd")).output == "/app\n"  # a fresh shell


async def test_exit_starts_a_new_shell(box):
    res = await box.shell.run("cd /tmp; exit 3")
    assert res.restarted and "the shell exited" in res.output
    assert (await box.shell.run("pwd")).output == "/app\n"


async def test_output_is_capped_with_a_marker(box):
    res = await box.shell.run("seq 1 20000", timeout=20)  # 108894 characters
    assert res.exit_code == 0 and res.cut_chars == 108894 - 16000
    assert res.output.startswith("1\n2\n") and res.output.rstrip().endswith("19999\n20000".split("\n")[-1])
    assert f"[... output truncated: {108894 - 16000} of 108894 characters cut ...]" in res.output
    flood = await box.shell.run("yes | head -c 4000000; echo; echo done", timeout=30)  # 4 MB: counted, not kept
    assert flood.exit_code == 0 and flood.output.endswith("y\n\ndone\n") and flood.output.startswith("y\ny\n")
    assert flood.cut_chars == 4000006 - 16000 and f"{4000006 - 16000} of 4000006 characters cut" in flood.output


def test_quoting_and_cap_helpers():
    assert ansi_c_quote("it's\n\\x") == "$'it\\'s\\n\\\\x'"
    text, cut = cap_output("a" * 50 + "b" * 50, 20)
    assert cut == 80 and text.startswith("a" * 10) and text.endswith("b" * 10) and "80 of 100 characters cut" in text
