"""Adversarial suite: one attack per property of the threat model (verl_agent/sandbox/__init__.py).

Every attack runs against the real process backend and the real Docker backend. Each must end with
the run reported as failed or timed out (or harmlessly contained), the server still healthy, the
next run clean, and the host untouched. Network tests never send traffic anywhere: they check that
there is no interface but lo and that connecting fails at once (a sandbox with a network sends nothing).

Each attack's containment check is ``contained(...)``, which raises ``Escaped``. ``test_weakened_twin``
runs the same attack against a sandbox with exactly the protection it tests removed (the backends'
test-only ``weaken``, probe.WEAKENINGS) and requires ``Escaped``: a check that cannot fail fails there.
A protection kept by several layers has a weakening that drops every layer of it; every case, with each of
its parameters, has a twin on both backends (``test_every_case_has_a_twin_or_a_reason``; a case that
could have none would be listed in ``NO_TWIN`` with the reason, and counted). The CPU quota's twin needs 1.5
idle cores (on a busy host there is no CPU to take beyond the quota): it skips without them, and fails
in CI (CI=true).
"""

from __future__ import annotations

import base64
import json
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

SECRET = "verl-sandbox-test-secret-" + uuid.uuid4().hex
os.environ["VERL_SANDBOX_TEST_SECRET"] = SECRET  # set before the servers start; must never leak in


class Escaped(AssertionError):
    """An attack's containment check failed: the attack got out of the sandbox or past a limit."""


def contained(ok: bool, detail: object = "") -> None:
    if not ok:
        raise Escaped(detail)


def healthy_and_clean(server, run) -> None:
    """The server answers, and runs on every idle worker see a clean, empty sandbox (the checks overlap,
    so each lands on a different worker)."""
    assert httpx.get(f"{server.url}/v1/ping", timeout=10).json() == "pong"
    server.wait_idle()
    check = ("import os, time\nleft = [d + '/' + f for d in ('/tmp', '/dev/shm', '/var/tmp') for f in os.listdir(d)]\n"
             "procs = [p for p in os.listdir('/proc') if p.isdigit() and int(p) not in (1, os.getpid())]\n"
             "print(sorted(left), len(procs))\ntime.sleep(0.3)")
    workers = {w.name for w, _ in server.service.pool._idle}
    seen: set[str] = set()
    for _ in range(5):  # on a loaded machine one round may not reach every worker
        with ThreadPoolExecutor(len(workers)) as pool:
            outs = list(pool.map(lambda _: run(server, check), range(len(workers))))
        for out in outs:
            assert out["status"] == "Success", out
            contained(out["run_result"]["stdout"] == "['/tmp/sandbox'] 0\n", out)  # nothing left by the attack
        seen |= {o["executor_pod_name"] for o in outs}
        if workers <= seen:
            break
    assert workers <= seen, (workers, seen)


def host_procs_matching(marker: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


# Prints the sandbox's process count each time it reaches a new peak (no fork needed to look).
OBSERVER = ("import os, time\nend, peak = time.monotonic() + 2.5, 0\nwhile time.monotonic() < end:\n"
            "    n = sum(p.isdigit() for p in os.listdir('/proc'))\n    if n > peak:\n"
            "        peak = n\n        print('peak', n, flush=True)\n    time.sleep(0.005)\n")
FORK_BOMBS = [
    ("bash", "cat > /tmp/observer.py <<'EOF'\nOBSERVER\nEOF\npython3 /tmp/observer.py &\nsleep 0.3\n"
             ":(){ :|:& };:; sleep 30"),
    # children that sleep (not fork on): 150 sleeping Pythons fit in the sandbox's memory without a pids limit
    ("python", "import os, subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', OBSERVER])\ntime.sleep(0.3)\n"
               "n = 0\nwhile True:\n    try:\n        if n < 150 and os.fork() == 0:\n            time.sleep(30)\n"
               "        n += 1\n    except OSError:\n        pass"),
]


@pytest.mark.parametrize("language,code", FORK_BOMBS, ids=["bash", "python"])
def test_fork_bomb(server, run, language, code):
    """The bomb never has more processes than the pids limit (counted inside while it runs), and times out."""
    code = code.replace("OBSERVER\n", OBSERVER, 1) if language == "bash" else f"OBSERVER = {OBSERVER!r}\n" + code
    out = run(server, code, language=language, run_timeout=3)
    stdout = (out["run_result"] or {}).get("stdout", "")
    peaks = [int(line.split()[1]) for line in stdout.splitlines() if line.startswith("peak ")]
    assert peaks, out  # the observer ran
    contained(max(peaks) <= server.service.pool.backend.pids, (max(peaks), out))
    assert out["status"] == "Failed" and out["run_result"]["status"] == "TimeLimitExceeded"
    healthy_and_clean(server, run)


def test_memory_bomb_one_process(server, run):
    """A run's memory_limit_MB holds for one process: 200 MB (under the sandbox's limit) fails at 128."""
    out = run(server, "x = b'x' * (200 << 20)\nprint('survived')", memory_limit_MB=128)
    contained("survived" not in out["run_result"]["stdout"], out)
    assert out["status"] == "Failed" and "MemoryError" in out["run_result"]["stderr"], out
    healthy_and_clean(server, run)


def test_memory_bomb_many_processes_under_the_limit(server, run):
    code = ("import os, time\nkids = []\nfor _ in range(6):\n    pid = os.fork()\n    if pid == 0:\n"
            "        x = b'x' * (200 << 20)\n        time.sleep(3)\n        os._exit(0)\n    kids.append(pid)\n"
            "bad = sum(os.waitpid(p, 0)[1] != 0 for p in kids)\nprint('killed', bad)\nexit(1 if bad else 0)")
    out = run(server, code, memory_limit_MB=256, run_timeout=20)  # 6 x 200 MB > the sandbox's 512 MB
    contained(out["status"] == "Failed" and "killed 0" not in out["run_result"]["stdout"], out)
    healthy_and_clean(server, run)


SPINS = ["while True: pass", "import threading\ndef spin():\n    while True: pass\n"
                             "for _ in range(8): threading.Thread(target=spin).start()\nspin()"]


@pytest.mark.parametrize("code", SPINS, ids=["loop", "threads"])
def test_cpu_spin_times_out(server, run, code):
    t0 = time.monotonic()
    out = run(server, code, run_timeout=1.5)
    contained((out["run_result"] or {}).get("status") == "TimeLimitExceeded" and time.monotonic() - t0 < 8, out)
    assert out["status"] == "Failed"
    healthy_and_clean(server, run)


# Four processes spin for 2 s; the run prints the CPU seconds they got per second of wall time.
SPIN = ("import os, time\nt0 = time.monotonic()\nfor _ in range(4):\n    if os.fork() == 0:\n"
        "        while time.monotonic() < t0 + 2:\n            pass\n        os._exit(0)\n"
        "for _ in range(4):\n    os.wait()\nt = os.times()\n"
        "print(round((t.children_user + t.children_system) / (time.monotonic() - t0), 2))")


def test_cpu_quota_holds_spinning_processes(server, run):
    """Under the sandbox's CPU quota (1 CPU here) four spinning processes get at most ~1 CPU-second per
    second, measured as their CPU time (a machine with more cores would give them more)."""
    out = run(server, SPIN, run_timeout=10)
    assert out["status"] == "Success", out
    ratio = float(out["run_result"]["stdout"])
    contained(ratio <= 1.25 * server.service.pool.backend.cpus, f"{ratio} CPU-s per s")


def test_sleep_past_timeout(server, run):
    out = run(server, "sleep 60", language="bash", run_timeout=1)
    contained((out["run_result"] or {}).get("status") == "TimeLimitExceeded", out)
    assert out["run_result"]["execution_time"] < 5


@pytest.mark.parametrize("exit_first", [True, False])
def test_escape_via_setsid_double_fork_nohup(server, run, exit_first):
    marker = f"{1000 + uuid.uuid4().int % 9000}.{uuid.uuid4().int % 1000}"
    code = (f"setsid sleep {marker} &\n( ( sleep {marker} & ) & )\nnohup sleep {marker} >/dev/null 2>&1 &\n"
            f"python3 -c 'import os\nif os.fork() == 0:\n  os.setsid()\n  os.execvp(\"sleep\", [\"sleep\", \"{marker}\"])'\n"
            + ("echo started" if exit_first else "sleep 60"))
    out = run(server, code, language="bash", run_timeout=2)
    assert out["status"] == ("Success" if exit_first else "Failed"), out
    deadline = time.monotonic() + 2  # the supervisor has killed and reaped them before it replied
    while host_procs_matching(f"sleep\0{marker}") and time.monotonic() < deadline:
        time.sleep(0.05)
    contained(host_procs_matching(f"sleep\0{marker}") == [], "a background child survived its run")
    healthy_and_clean(server, run)


def test_output_floods_are_capped_and_prompt(server, run):
    cap = server.service.settings.max_output_bytes
    t0 = time.monotonic()
    out = run(server, "import sys\nsys.stdout.write('o' * (1 << 20))\nsys.stderr.write('e' * (1 << 20))")
    assert time.monotonic() - t0 < 5 and out["status"] == "Success"
    for stream in ("stdout", "stderr"):
        text = out["run_result"][stream]
        contained(len(text) < cap + 100, (stream, len(text)))
        assert text.startswith(stream[3] * cap) and "truncated" in text
    endless = run(server, "yes flood", language="bash", run_timeout=1.5)
    assert endless["run_result"]["status"] == "TimeLimitExceeded"
    assert len(endless["run_result"]["stdout"]) < cap + 100


def test_jupyter_display_and_errors_are_capped(server, run):
    """A notebook's displayed repr and an error's message and traceback obey max_output_bytes too (cut in
    the kernel, inside the sandbox), keeping the display's head and the traceback's last lines."""
    cap = server.service.settings.max_output_bytes
    deep = ("import sys\nsys.setrecursionlimit(10000)\n"  # 3000 distinct frames: a traceback over the cap
            "src = ''.join(f'def f{i}():\\n    return f{i + 1}()\\n' for i in range(3000))\n"
            "exec(compile(src + 'def f3000():\\n    return 1 / 0', '<cell>', 'exec'))\nf0()")
    cells = ["list(range(200000))", deep, "raise ValueError('x' * 300000)"]
    out = [httpx.post(f"{server.url}/run_jupyter", json={"cells": [c]}, timeout=60).json()["cells"][0] for c in cells]
    shown = out[0]["display"][0]["text/plain"]
    contained(len(shown) < cap + 100, len(shown))
    assert shown.startswith("[0, 1, 2") and "truncated" in shown, shown[:100]
    for cell, last in ((out[1], "ZeroDivisionError: division by zero\n"), (out[2], None)):
        error = cell["error"][0]
        assert len(json.dumps(error)) < 2 * cap + 500, len(json.dumps(error))
        assert "truncated" in error["traceback"][0] and len(error["traceback"]) > 1
        assert error["traceback"][-1] == last if last else error["traceback"][-1].startswith("ValueError: xxx")
    assert "truncated" in out[2]["error"][0]["evalue"] and len(out[2]["stderr"]) < cap + 100


@pytest.mark.parametrize("mode", ["session", "jupyter"])
def test_a_process_forked_by_a_cell_never_answers_as_the_kernel(server, run, mode):
    """A child forked in a session or notebook cell that calls sys.exit (or just runs to the end of the
    cell) ends there: the cell's reply is the kernel's own, and the next cells see the same kernel."""
    fork = ("import os, sys, time\nif os.fork() == 0:\n    sys.exit(3)\nif os.fork() == 0:\n    x = 1\n"
            "time.sleep(0.5)\nkept = 'parent'\n")
    if mode == "jupyter":
        body = {"cells": [fork + "kept", "kept + ' again'", "print(os.getpid() == KERNEL)"]}
        body["cells"][0] = "import os\nKERNEL = os.getpid()\n" + body["cells"][0]
        out = httpx.post(f"{server.url}/run_jupyter", json=body, timeout=60).json()
        cells = out.get("cells") or [{}] * 3
        contained(out["status"] == "Success" and [c.get("display") for c in cells[:2]] == [
            [{"text/plain": "'parent'"}], [{"text/plain": "'parent again'"}]], out)
        assert cells[2]["stdout"] == "True\n" and all(c["error"] == [] for c in cells), out
        return
    sid = httpx.post(f"{server.url}/open_session", timeout=30).json()["session_id"]
    try:
        # the child that runs to the end of the cell would print too (and may flush before the kernel reads
        # the output: fork semantics), so only the forking process prints here
        first = run(server, "import os\nme = os.getpid()\n" + fork + "if os.getpid() == me:\n    print(kept)",
                    session_id=sid)
        contained(first["status"] == "Success" and first["run_result"]["stdout"] == "parent\n", first)
        for code, want in (("print(kept, 2)", "parent 2\n"), ("print(kept, 3)", "parent 3\n")):
            out = run(server, code, session_id=sid)
            contained(out["status"] == "Success" and (out["run_result"] or {}).get("stdout") == want, out)
    finally:
        httpx.post(f"{server.url}/close_session", json={"session_id": sid}, timeout=30)


def test_disk_fill(server, run):
    """Writing twice the scratch size fails: the tmpfs is full."""
    twice = 2 * server.service.pool.backend.tmpfs_mb
    out = run(server, f"dd if=/dev/zero of=/tmp/fill bs=1M count={twice} && echo filled", language="bash",
              run_timeout=20)
    contained("filled" not in out["run_result"]["stdout"], out)
    assert out["status"] == "Failed" and "No space left" in out["run_result"]["stderr"]
    healthy_and_clean(server, run)


def test_system_files_are_read_only(server, run):
    """A run cannot change the system: /etc and /usr refuse a new file (a read-only root; on Docker also
    the image's files owned by root, not by the run's uid)."""
    ro = run(server, "echo x > /etc/owned; echo x > /usr/owned; ls /etc/owned /usr/owned", language="bash")
    contained(ro["status"] == "Failed" and ro["run_result"]["stdout"] == "", ro)
    assert any(e in ro["run_result"]["stderr"] for e in ("Read-only file system", "Permission denied")), ro


def test_leftover_files_are_not_visible_to_the_next_run(server, run):
    tag = uuid.uuid4().hex
    out = run(server, f"for d in /tmp /dev/shm /var/tmp /tmp/sandbox; do echo s > $d/{tag}; done; ls /tmp/{tag}",
              language="bash")
    assert out["status"] == "Success"
    assert not os.path.exists(f"/tmp/{tag}")  # the host's /tmp is not the sandbox's
    healthy_and_clean(server, run)


def test_dev_is_read_only_and_nothing_outside_scratch_is_writable(server, run):
    """/dev is never wiped, so a run must not be able to leave a file (or fill memory) there: creating one
    fails, the next run sees nothing, and /dev/null, /dev/zero, /dev/urandom and /dev/shm work as usual.
    The start-up probe's own check, run as a user's program, finds nothing writable outside the scratch
    dirs the agent wipes (which are the probe's)."""
    from verl_agent.sandbox import agent
    from verl_agent.sandbox.backends.probe import PROBE, SCRATCH

    assert sorted(agent.SCRATCH) == sorted(SCRATCH)
    tag = uuid.uuid4().hex
    code = (f"echo leak > /dev/{tag}; mkdir /dev/d{tag}; echo made $(ls /dev | grep -c {tag})\n"
            "echo x > /dev/null && head -c 4 /dev/zero | wc -c && head -c 8 /dev/urandom | wc -c\n"
            "echo shm > /dev/shm/ok && cat /dev/shm/ok")
    out = run(server, code, language="bash")
    contained(out["run_result"]["stdout"].startswith("made 0\n"), out)
    assert out["status"] == "Success", out
    assert out["run_result"]["stdout"] == "made 0\n4\n8\nshm\n", out
    assert any(e in out["run_result"]["stderr"] for e in ("Read-only file system", "Permission denied")), out
    want = {"memory": 0, "pids": 0, "tmp": 0, "scratch": SCRATCH, "cgroups_inside": False}
    probe = run(server, f"import sys\nsys.argv = ['probe', {json.dumps(want)!r}]\n" + PROBE)
    found = json.loads(probe["run_result"]["stdout"].splitlines()[-1])
    contained(found["only_scratch_writable"][0], found["only_scratch_writable"])
    healthy_and_clean(server, run)


def test_network_has_no_route(server, run):
    code = ("import os, socket, sys, time\nnames = sorted(name for _, name in socket.if_nameindex())\nprint(names)\n"
            "if names != ['lo']:\n    sys.exit(0)  # a network: send nothing\n"
            "for host, port in [('203.0.113.1', 80), ('127.0.0.1', PORT)]:\n    t = time.monotonic()\n"
            "    s = socket.socket()\n    s.settimeout(5)\n    try:\n        s.connect((host, port)); print('CONNECTED')\n"
            "    except OSError as e:\n        print(host, type(e).__name__, round(time.monotonic() - t, 1))\n"
            "try:\n    socket.getaddrinfo('example.com', 80); print('RESOLVED')\nexcept OSError as e:\n"
            "    print('dns', type(e).__name__)").replace("PORT", str(server.port))
    out = run(server, code)
    lines = out["run_result"]["stdout"].splitlines()
    contained(lines[0] == "['lo']", out)
    assert lines[1].startswith("203.0.113.1 OSError 0.0")  # ENETUNREACH at once, nothing sent
    assert lines[2] == "127.0.0.1 ConnectionRefusedError 0.0"  # the server's own port is not reachable
    assert lines[3].startswith("dns ")


def test_secrets_do_not_leak(server, run):
    code = ("printenv; cat /proc/1/environ; for e in /proc/[0-9]*/environ; do cat $e; done;"
            " ls -la /var/run/docker.sock /run/docker.sock; ls /root; true")
    out = run(server, code, language="bash")
    text = out["run_result"]["stdout"] + out["run_result"]["stderr"]
    contained(SECRET not in text and "VERL_SANDBOX_TEST_SECRET" not in text, "the host's secret is visible")
    assert "srw" not in out["run_result"]["stdout"]  # no docker socket
    env = dict(line.split("=", 1) for line in out["run_result"]["stdout"].splitlines() if "=" in line[:40])
    assert set(env) <= {"PATH", "HOME", "LANG", "TMPDIR", "PWD", "SHLVL", "_", "OLDPWD"}, env


TRAVERSALS = [("files", "../escape.txt"), ("files", "/etc/escape.txt"), ("files", "a/../../escape.txt"),
              ("fetch_files", "/etc/passwd"), ("fetch_files", "../../../etc/hostname"),
              ("fetch_files", "/proc/1/environ")]


@pytest.mark.parametrize("field,path", TRAVERSALS)
def test_path_traversal_is_refused(server, run, field, path):
    """A path outside the work dir is refused as such, naming it, before anything is written or read (a
    refusal for another reason, such as /etc being read-only, is another layer's work)."""
    value = {path: base64.b64encode(b"x").decode()} if field == "files" else [path]
    out = run(server, "print(1)", **{field: value})
    refused = ("outside the work directory", "escapes the work directory")
    contained(out["files"] == {} and any(r in out["message"] for r in refused), out)
    assert out["status"] == "Failed" and path in out["message"], out


def test_symlink_exfiltration_through_fetch_files(server, run):
    """Symlinks to a system file (present in both backends' sandboxes) and to its directory fetch nothing."""
    code = "import os\nos.symlink('/usr/lib/os-release', 'leak.txt')\nos.symlink('/usr/lib', 'libdir')"
    out = run(server, code, fetch_files=["leak.txt", "libdir/os-release"])
    contained(out["files"] == {}, out)
    assert "symlink" in out["message"], out


def test_no_privilege_escalation(server, run):
    """No capability in any set (effective, permitted, inheritable, bounding, ambient), a non-root uid, and
    sudo, su, setuid(0) and every setuid binary leave it so."""
    code = ("grep -E '^Cap(Inh|Prm|Eff|Bnd|Amb)' /proc/self/status; id -u; sudo id 2>&1 | head -1;"
            " su -c 'id -u' root </dev/null 2>&1 | head -1;"
            " python3 -c 'import os; os.setuid(0); print(\"ROOT\")' 2>&1 | tail -1;"
            " for f in $(find / -xdev -perm -4000 -type f 2>/dev/null); do $f --version >/dev/null 2>&1; done; id -u")
    out = run(server, code, language="bash")
    lines = out["run_result"]["stdout"].splitlines()
    caps = dict(line.split(":") for line in lines[:5])
    contained(len(caps) == 5 and all(int(v, 16) == 0 for v in caps.values()), caps)
    contained(lines[5] != "0" and lines[-1] != "0" and "ROOT" not in out["run_result"]["stdout"], out)
    assert "Error" in out["run_result"]["stdout"]


def test_many_parallel_runs_race(server, run):
    """Runs at once never share a scratch dir: each reads back what it wrote a moment before."""
    code = ("import sys, time\nn = sys.stdin.read()\nopen('mine.txt', 'w').write(n)\ntime.sleep(0.2)\n"
            "print(open('mine.txt').read())")
    with ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(lambda i: run(server, code, stdin=str(i)), range(40)))
    # a run that did not finish (its scratch dir taken from under it) has no run_result: that is a race lost too
    contained([(o["run_result"] or {}).get("stdout") for o in outs] == [f"{i}\n" for i in range(40)], outs)


def test_zombies_are_reaped(server, run):
    code = "import os\nfor _ in range(50):\n    if os.fork() == 0: os._exit(0)\nprint('made zombies')"
    assert run(server, code)["status"] == "Success"
    healthy_and_clean(server, run)


EXHAUST = {  # open files / threads until refused (at most a bounded number); prints how many it got
    "fds": "fs = []\ntry:\n    while len(fs) < 4096:\n        fs.append(open('/dev/null'))\nexcept OSError:\n"
           "    pass\nprint(len(fs))",
    "threads": "import threading, time\nthreading.stack_size(64 << 10)\nn = 0\ntry:\n    while n < 400:\n"
               "        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n        n += 1\n"
               "except RuntimeError:\n    pass\nprint(n, flush=True)\nimport os\nos._exit(0)",
}


@pytest.mark.parametrize("kind", ["fds", "threads"])
def test_fd_and_thread_exhaustion(server, run, kind):
    """Open files stop at the 1024 limit, threads at the pids limit (a thread is a task), well before 4096 / 400."""
    out = run(server, EXHAUST[kind], run_timeout=10, memory_limit_MB=512)
    assert out["status"] == "Success", out
    got = int(out["run_result"]["stdout"])
    contained(got < (1024 if kind == "fds" else server.service.pool.backend.pids), f"{kind}: {got}")
    healthy_and_clean(server, run)


def test_huge_request_body_and_huge_stdin(server, run):
    """A body over the limit is refused with 413 whether its length is declared or it comes chunked (no
    Content-Length); a large stdin under the limit reaches the program whole."""
    big = "x" * (9 << 20)  # over the test server's 8 MiB body limit
    response = httpx.post(f"{server.url}/run_code", json={"code": "print(1)", "language": "python", "stdin": big},
                          timeout=30)
    contained(response.status_code == 413, response.status_code)
    body = json.dumps({"code": "print(1)", "language": "python", "stdin": big}).encode()
    pieces = (body[i:i + (1 << 20)] for i in range(0, len(body), 1 << 20))  # a generator: sent chunked
    chunked = httpx.post(f"{server.url}/run_code", content=pieces, headers={"content-type": "application/json"},
                         timeout=30)
    assert chunked.status_code == 413 and "too large" in chunked.json()["message"], chunked.text
    small = json.dumps({"code": "print(2)", "language": "python"}).encode()
    ok = httpx.post(f"{server.url}/run_code", content=iter([small[:10], small[10:]]),
                    headers={"content-type": "application/json"}, timeout=30)
    assert ok.status_code == 200 and ok.json()["run_result"]["stdout"] == "2\n", ok.text
    out = run(server, "import sys\nprint(len(sys.stdin.read()))", stdin="y" * (5 << 20))
    assert out["run_result"]["stdout"] == f"{5 << 20}\n"


# A victim run in another sandbox: its secret (from stdin) goes to files in every scratch dir and the
# work dir, an open fd, its argv and its environment; then it sleeps with MARKER in its argv so the
# test (on the host) can see that it is alive while the attacker runs.
VICTIM = """import os, sys
secret = sys.stdin.read().strip()
for d in ('/tmp', '/var/tmp', '/dev/shm', '.'):
    with open(d + '/victim-secret.txt', 'w') as f:
        f.write(secret)
fd = os.open('/tmp/victim-secret.txt', os.O_RDONLY)
os.set_inheritable(fd, True)
os.execve('/usr/bin/python3', ['python3', '-c', 'import time; time.sleep(SLEEP); print("victim done")', 'MARKER', secret],
          dict(os.environ, VICTIM_SECRET=secret))
"""


def start_victim(server, run, pool, secret: str, sleep: float = 6.0):
    """Submit the victim and wait until it is running (seen from the host); returns (future, marker)."""
    marker = "victim-" + uuid.uuid4().hex
    future = pool.submit(run, server, VICTIM.replace("SLEEP", str(sleep)).replace("MARKER", marker), stdin=secret,
                         run_timeout=sleep + 10)
    deadline = time.monotonic() + 30
    while not host_procs_matching(marker):
        assert time.monotonic() < deadline and not future.done(), future.result() if future.done() else "no victim"
        time.sleep(0.02)
    return future, marker


def test_signal_every_visible_process(server, run):
    """SIGSTOP/SIGTERM/SIGKILL to every pid the run can see and kill(-1): nothing but the run dies."""
    attack = ("import os, signal\nme, hit, errors = os.getpid(), set(), []\n"
              "for sig in (signal.SIGSTOP, signal.SIGTERM, signal.SIGKILL):\n"
              "    for pid in [int(p) for p in os.listdir('/proc') if p.isdigit() and int(p) != me]:\n"
              "        try:\n            os.kill(pid, sig); hit.add(pid)\n"
              "        except OSError as e:\n            errors.append(type(e).__name__)\n"
              "try:\n    os.kill(-1, signal.SIGKILL)\nexcept OSError as e:\n    errors.append(type(e).__name__)\n"
              "for path in ('/proc/1/fd/1', '/proc/1/mem'):\n    try:\n"
              "        open(path, 'wb').write(b'garbage'); print('WROTE', path)\n"
              "    except OSError as e:\n        print(path, type(e).__name__)\n"
              "print('hit', sorted(hit))")
    recycled = server.service.pool.recycled
    with ThreadPoolExecutor(1) as pool:
        victim, marker = start_victim(server, run, pool, uuid.uuid4().hex)
        out = run(server, attack)
        contained(host_procs_matching(marker), "the victim died while the attacker ran")
        v = victim.result()
    lines = (out["run_result"] or {}).get("stdout", "").splitlines()  # None: it killed its own supervisor
    contained(lines[-1:] == ["hit [1]"], out)  # the only other process it can see is its own sandbox's agent
    assert out["status"] == "Success", out
    assert not any(line.startswith("WROTE") for line in lines), out
    assert v["status"] == "Success" and v["run_result"]["stdout"] == "victim done\n", v
    assert server.service.pool.recycled == recycled  # both agents survived: nothing was replaced
    healthy_and_clean(server, run)


# The spy: a decoy child of its own carries CANARY (from stdin) in a file, an fd, its argv and its
# environment, so every channel below is shown to work (it must find the canary through each);
# then it reads every visible /proc/*/{cmdline,environ,fd/*} and every file under the shared
# scratch dirs (also through /proc/*/root and /proc/*/cwd) and prints each 32-hex token per channel.
SPY = """import os, re, stat, subprocess, sys
canary = sys.stdin.read().strip()
with open('/tmp/spy-canary.txt', 'w') as f:
    f.write(canary)
fd = os.open('/tmp/spy-canary.txt', os.O_RDONLY)
decoy = subprocess.Popen(['/usr/bin/python3', '-c', 'import time; time.sleep(30)', canary], pass_fds=(fd,),
                         env={'SPY_CANARY': canary})
os.close(fd)
tokens = set()
def note(channel, data):
    for t in re.findall(rb'[0-9a-f]{32}', data):
        tokens.add(channel + ' ' + t.decode())
def read(path, limit=1 << 20):
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return b''
    try:
        return os.read(fd, limit) if stat.S_ISREG(os.fstat(fd).st_mode) else b''
    except OSError:
        return b''
    finally:
        os.close(fd)
import time
time.sleep(0.3)
pids = [p for p in os.listdir('/proc') if p.isdigit() and int(p) != os.getpid()]
roots = ['/tmp', '/var/tmp', '/dev/shm', '.']
for pid in pids:
    for name in ('cmdline', 'environ'):
        try:
            note(name, open(f'/proc/{pid}/{name}', 'rb').read())
        except OSError:
            pass
    try:
        fds = os.listdir(f'/proc/{pid}/fd')
    except OSError:
        fds = []
    for n in fds:
        try:
            note('fd', os.readlink(f'/proc/{pid}/fd/{n}').encode())
            f = os.open(f'/proc/{pid}/fd/{n}', os.O_RDONLY | os.O_NONBLOCK)
            try:
                if stat.S_ISREG(os.fstat(f).st_mode):
                    note('fd', os.pread(f, 1 << 20, 0))
            finally:
                os.close(f)
        except OSError:
            pass
    roots += [f'/proc/{pid}/cwd'] + [f'/proc/{pid}/root{d}' for d in ('/tmp', '/var/tmp', '/dev/shm')]
for root in roots:
    for d, dirs, files in os.walk(root):
        for name in files:
            note('files', read(os.path.join(d, name)))
decoy.kill()
print('\\n'.join(sorted(tokens)))
"""


def test_cannot_snoop_a_concurrent_run(server, run):
    secret, canary = uuid.uuid4().hex, uuid.uuid4().hex
    with ThreadPoolExecutor(1) as pool:
        victim, marker = start_victim(server, run, pool, secret, sleep=10)
        seen = run(server, SPY, stdin=canary, run_timeout=20)
        contained(secret not in json.dumps(seen), "the spy saw the victim's secret")
        overlapped = bool(host_procs_matching(marker))
        v = victim.result()
    assert seen["status"] == "Success", seen
    found: dict[str, set[str]] = {}
    for line in seen["run_result"]["stdout"].splitlines():
        channel, token = line.split()
        found.setdefault(channel, set()).add(token)
    for channel in ("cmdline", "environ", "fd", "files"):  # the spy saw no victim, though its reading works on each
        assert canary in found.get(channel, set()), (channel, seen)
    assert overlapped, "the victim was not running for the whole spy run (or the spy's clean-up killed it)"
    assert v["status"] == "Success", v


def test_supervisor_ignores_modules_planted_in_its_directory(server, run):
    """The supervisor's exact command line (read from /proc/1/cmdline), started from a directory holding
    planted stdlib names, must not import them; without ``-I`` it would (checked as a control)."""
    code = ("import os, subprocess\nargv = [a.decode() for a in open('/proc/1/cmdline', 'rb').read().split(b'\\0')[:-1]]\n"
            "print('isolated flag', '-I' in argv)\nd = '/tmp/plant'\nos.makedirs(d)\n"
            "for mod in ('json', 'ctypes', 'selectors', 'shutil', 'base64', 'subprocess', 'signal'):\n"
            "    open(f'{d}/{mod}.py', 'w').write('import os\\nos.write(2, b\"PLANTED-IMPORTED\\\\n\")\\n')\n"
            "def start(a):\n    p = subprocess.run(a, cwd=d, stdin=subprocess.DEVNULL, capture_output=True, timeout=30)\n"
            "    return p.stdout + p.stderr\n"
            "real = start(argv)\nprint('real planted', b'PLANTED-IMPORTED' in real, 'ready', b'\"ready\": true' in real)\n"
            "weak = start([a for a in argv if a != '-I'])\nprint('control planted', b'PLANTED-IMPORTED' in weak)")
    out = run(server, code)
    assert out["status"] == "Success", out
    lines = out["run_result"]["stdout"].splitlines()
    contained(lines[:2] == ["isolated flag True", "real planted False ready True"], out)
    assert lines[2:] == ["control planted True"], out
    healthy_and_clean(server, run)


# -- weakened twins -------------------------------------------------------------------------------------

# (attack, its parameters, the one protection removed[, the backends it applies to]): each attack must
# report Escaped on a sandbox without it. A protection kept by several layers is removed whole (its
# weakening drops every layer, probe.WEAKENINGS); "a+b" removes two where a backend keeps the guarantee
# with both (Docker's system files: a read-only root, and the image's files owned by root). Limits are
# raised to a bounded multiple (memory x8, pids x16, scratch size x8, open files 8192), never removed; run
# limits are lifted in every job the worker sends (time x1000, memory none, output cap 16 MiB);
# body_limit is the HTTP server's (64 MiB instead of 8).
TWINS = [
    (test_fork_bomb, FORK_BOMBS[0], "pids_limit"),
    (test_fork_bomb, FORK_BOMBS[1], "pids_limit"),
    (test_fd_and_thread_exhaustion, ("threads",), "pids_limit"),
    (test_fd_and_thread_exhaustion, ("fds",), "fd_limit"),
    (test_memory_bomb_one_process, (), "run_memory_limit"),
    (test_memory_bomb_many_processes_under_the_limit, (), "memory_limit"),
    (test_cpu_quota_holds_spinning_processes, (), "cpu_limit"),
    (test_cpu_spin_times_out, (SPINS[0],), "run_timeout"),
    (test_cpu_spin_times_out, (SPINS[1],), "run_timeout"),
    (test_sleep_past_timeout, (), "run_timeout"),
    (test_escape_via_setsid_double_fork_nohup, (True,), "no_leftover_processes"),
    (test_escape_via_setsid_double_fork_nohup, (False,), "no_leftover_processes"),
    (test_zombies_are_reaped, (), "no_leftover_processes"),
    (test_output_floods_are_capped_and_prompt, (), "output_cap"),
    (test_jupyter_display_and_errors_are_capped, (), "output_cap"),
    (test_disk_fill, (), "disk_limit"),
    (test_system_files_are_read_only, (), "read_only_system", ("process",)),
    (test_system_files_are_read_only, (), "read_only_system+non_root_uid", ("docker",)),
    (test_dev_is_read_only_and_nothing_outside_scratch_is_writable, (), "only_scratch_writable"),
    (test_network_has_no_route, (), "no_network"),
    (test_secrets_do_not_leak, (), "no_host_env"),
    *[(test_path_traversal_is_refused, case, "paths_confined") for case in TRAVERSALS],
    (test_symlink_exfiltration_through_fetch_files, (), "no_symlink_follow"),
    (test_no_privilege_escalation, (), "no_capabilities"),
    (test_no_privilege_escalation, (), "non_root_uid"),
    (test_many_parallel_runs_race, (), "private_tmp"),
    (test_signal_every_visible_process, (), "own_pid_namespace"),
    (test_cannot_snoop_a_concurrent_run, (), "own_pid_namespace"),
    (test_supervisor_ignores_modules_planted_in_its_directory, (), "isolated_mode"),
    (test_leftover_files_are_not_visible_to_the_next_run, (), "scratch_wipe"),
    (test_a_process_forked_by_a_cell_never_answers_as_the_kernel, ("session",), "fork_guard"),
    (test_a_process_forked_by_a_cell_never_answers_as_the_kernel, ("jupyter",), "fork_guard"),
    (test_huge_request_body_and_huge_stdin, (), "body_limit"),
]
BACKENDS = ("process", "docker")

# (backend, case name, its parameters) -> why that case has no weakened twin there. None today: add one
# only with the reason; test_every_case_has_a_twin_or_a_reason counts it as a case without a twin.
NO_TWIN: dict[tuple[str, str, tuple], str] = {}


def idle_cores(seconds: float = 1.0) -> float:
    """Idle CPU cores of the host over ``seconds`` (/proc/stat)."""
    def sample() -> list[int]:
        with open("/proc/stat") as f:
            return [int(x) for x in f.readline().split()[1:]]

    a = sample()
    time.sleep(seconds)
    b = sample()
    delta = [y - x for x, y in zip(a, b)]
    return (delta[3] + delta[4]) / max(sum(delta), 1) * (os.cpu_count() or 1)


def _twin_id(backend: str, weakening: str, attack, args: tuple) -> str:
    shown = [["loop", "threads"][SPINS.index(a)] if a in SPINS else str(a) for a in args]
    arg = f"[{'-'.join(a for a in shown if len(a) < 40)}]" if args else ""
    return f"{backend}-{weakening}-{attack.__name__.removeprefix('test_')}{arg}"


def twin_cases() -> list[tuple[str, str, object, tuple]]:
    """(backend, weakening, attack, its parameters) of every twin, grouped by server (each starts once)."""
    return sorted([(b, w, a, tuple(args)) for a, args, w, *on in TWINS for b in (on[0] if on else BACKENDS)],
                  key=lambda t: (t[0], t[1]))


@pytest.mark.parametrize("backend,weakening,attack,args",
                         [pytest.param(*t, id=_twin_id(t[0], t[1], t[2], t[3])) for t in twin_cases()])
def test_weakened_twin(weak_server, run, backend, weakening, attack, args):
    """The attack's containment check fails (Escaped) once the protection it tests is removed."""
    if weakening == "cpu_limit" and (idle := idle_cores()) < 1.5:
        # more CPU than the quota can only be taken where there is more: on a busy host the escape cannot show
        reason = f"the host has {idle:.1f} idle cores; the CPU twin needs 1.5"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"CI=true and {reason}")
        pytest.skip(reason)
    # without a PID namespace every run's clean-up kills the other sandboxes of its uid: a fresh server each
    server = weak_server(backend, weakening, fresh=weakening == "own_pid_namespace")
    with pytest.raises(Escaped):
        attack(server, run, *args)


def security_cases() -> set[tuple[str, tuple]]:
    """Every case of this suite: (test name, its parameters), one per parametrization."""
    found = set()
    for name, fn in list(globals().items()):
        if not name.startswith("test_") or name in ("test_weakened_twin", "test_every_case_has_a_twin_or_a_reason"):
            continue
        marks = [m for m in getattr(fn, "pytestmark", []) if m.name == "parametrize"]
        assert len(marks) <= 1, f"{name}: one parametrize mark at most (the check below reads one)"
        params: list[tuple] = [()]
        if marks:
            names, values = marks[0].args[:2]
            one = len(names.split(",") if isinstance(names, str) else names) == 1
            params = [(v,) if one else tuple(v) for v in values]
        found |= {(name, p) for p in params}
    return found


def test_every_case_has_a_twin_or_a_reason():
    """Each case, with each of its parameters, on each backend, has a weakened twin there (or a reason in
    NO_TWIN), and each twin's weakening is one the backends know."""
    from verl_agent.sandbox.backends.probe import WEAKENINGS

    cases = {(b, name, p) for b in BACKENDS for name, p in security_cases()}
    twinned = {(b, a.__name__, args) for b, _, a, args in twin_cases()}
    assert twinned <= cases, twinned - cases  # a twin of a case (or parameters) that is gone
    assert not twinned & set(NO_TWIN), twinned & set(NO_TWIN)
    assert cases == twinned | set(NO_TWIN), sorted(cases - twinned - set(NO_TWIN))
    known = set(WEAKENINGS) | {"body_limit"}
    assert all(set(w.split("+")) <= known for _, w, _, _ in twin_cases())
    assert len(cases) == 2 * 36 and not NO_TWIN  # 36 cases per backend, every one with a twin
