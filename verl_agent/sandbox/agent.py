"""In-sandbox supervisor: runs INSIDE a container / bubblewrap sandbox as the unprivileged run user.

Standard library only (it runs on the runner image's Debian python3). The server starts it as
PID 1 of the sandbox's PID namespace (``python3 -I -u -c <this source> <workdir> <kernel source>``)
and talks to it with one JSON object per line on stdin/stdout. Being PID 1 matters: a program
cannot SIGKILL it from inside the namespace, and ``kill(-1, SIGKILL)`` from here reaches every
other process of the sandbox, including ``setsid``/double-forked children. The agent makes itself
non-dumpable so programs of the same uid can neither ptrace it nor read its /proc files.

Ops: ``run`` (write files, run steps with timeouts and capped output, fetch files, clean up),
``session`` (run a cell in a persistent Python kernel), ``jupyter`` (fresh kernel, many cells).
Every reply carries ``dirty``: True when the sandbox may hold leftovers and must be recycled.
The server never trusts this process for its own safety: it keeps a hard deadline of its own.
"""

import base64
import json
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import time

WORK = sys.argv[1] if len(sys.argv) > 1 else "/tmp/sandbox"
KERNEL_SRC = sys.argv[2] if len(sys.argv) > 2 else ""
SCRATCH = ("/tmp", "/dev/shm", "/var/tmp", "/dev/mqueue")
ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": WORK, "LANG": "C.UTF-8", "TMPDIR": "/tmp"}
_kernel = None  # the session kernel (Popen) while a session is open
PROTECT = set()  # pids whose exit status a Popen object still has to collect


def _nondumpable() -> None:
    try:
        import ctypes

        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4
    except Exception:  # noqa: BLE001 - best effort; the server reports the guarantee it can prove
        pass


def _limits(mem_mb: int):
    def apply() -> None:
        try:
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write("1000")  # the program, never the agent, is the OOM killer's first choice
        except OSError:
            pass
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if mem_mb > 0:
            resource.setrlimit(resource.RLIMIT_AS, (mem_mb << 20, mem_mb << 20))

    return apply


def kill_others() -> None:
    """SIGKILL every process of the sandbox except this one (and reap them)."""
    try:
        os.kill(-1, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    end = time.monotonic() + 1.0
    while True:  # wait for the kernel to finish them off, so /proc shows what really survived
        reap()
        if not [p for p in others() if p not in PROTECT] or time.monotonic() > end:
            return
        time.sleep(0.002)


def others() -> list:
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]


def reap() -> None:
    """Collect exited orphans (we are PID 1), leaving PROTECT'ed pids to their Popen."""
    for pid in others():
        if pid in PROTECT:
            continue
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass


def _cap(data: bytearray, dropped: int) -> str:
    text = bytes(data).decode("utf-8", errors="replace")
    return text + (f"\n...[truncated {dropped} bytes]" if dropped else "")


def _pump(proc, stdin: bytes, deadline: float, cap: int):
    """Feed stdin, read stdout/stderr (capped, draining the rest) until exit + EOF or the deadline."""
    sel = selectors.DefaultSelector()
    bufs = {proc.stdout.fileno(): bytearray(), proc.stderr.fileno(): bytearray()}
    dropped = dict.fromkeys(bufs, 0)
    for fd in bufs:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    win = proc.stdin.fileno()
    os.set_blocking(win, False)
    if stdin:
        sel.register(win, selectors.EVENT_WRITE)
    else:
        proc.stdin.close()
    pos, timed_out, exited_at = 0, False, None
    while sel.get_map():
        now = time.monotonic()
        if now >= deadline:
            timed_out = proc.poll() is None
            break
        if exited_at is None and proc.poll() is not None:
            exited_at = now
            kill_others()  # leftovers (nohup &, double fork) die with the main program
        if exited_at is not None and now - exited_at > 1.0:
            break
        for key, _ in sel.select(min(deadline - now, 0.05)):
            fd = key.fd
            if fd == win:
                try:
                    pos += os.write(fd, stdin[pos:pos + 65536])
                except OSError:
                    pos = len(stdin)
                if pos >= len(stdin):
                    sel.unregister(fd)
                    proc.stdin.close()
                continue
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                sel.unregister(fd)
                continue
            room = cap - len(bufs[fd])
            bufs[fd] += chunk[:max(room, 0)]
            dropped[fd] += max(len(chunk) - max(room, 0), 0)
    sel.close()
    out, err = (_cap(bufs[fd], dropped[fd]) for fd in bufs)
    return out, err, timed_out


def run_step(step: dict, cap: int) -> dict:
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            step["argv"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            cwd=WORK, env=ENV, start_new_session=True, preexec_fn=_limits(step.get("memory_mb", 0)),
        )
    except OSError as e:
        return {"status": "Error", "execution_time": 0.0, "return_code": None, "stdout": "",
                "stderr": f"cannot start {step['argv'][0]}: {e}"}
    PROTECT.add(proc.pid)
    stdin = (step.get("stdin") or "").encode()
    out, err, timed_out = _pump(proc, stdin, start + float(step["timeout"]), cap)
    kill_others()
    rc = proc.wait()
    PROTECT.discard(proc.pid)
    return {"status": "TimeLimitExceeded" if timed_out else "Finished",
            "execution_time": round(time.monotonic() - start, 4),
            "return_code": None if timed_out else rc, "stdout": out, "stderr": err}


def _inside(path: str) -> str:
    full = os.path.normpath(os.path.join(WORK, path))
    if not (full + "/").startswith(WORK.rstrip("/") + "/") or full == WORK:
        raise ValueError(f"path {path!r} is outside the work directory {WORK}")
    return full


def write_files(files: dict) -> None:
    for path, b64 in files.items():
        full = _inside(path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        if os.path.realpath(os.path.dirname(full)) != os.path.dirname(full):
            raise ValueError(f"path {path!r} goes through a symlink")
        fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o700)
        with os.fdopen(fd, "wb") as f:
            f.write(base64.b64decode(b64 or ""))


def fetch_files(paths: list, cap: int) -> tuple:
    files, errors = {}, []
    for path in paths:
        try:
            full = _inside(path)
            if os.path.realpath(full) != full:
                raise ValueError(f"path {path!r} is a symlink; not fetched")
            fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            with os.fdopen(fd, "rb") as f:
                if not os.path.isfile(full):
                    raise ValueError(f"path {path!r} is not a regular file")
                data = f.read(cap + 1)
            if len(data) > cap:
                raise ValueError(f"file {path!r} is larger than {cap} bytes; not fetched")
            files[path] = base64.b64encode(data).decode()
        except (OSError, ValueError) as e:
            errors.append(str(e))
    return files, errors


def _wipe(root: str) -> bool:
    ok = True
    try:
        entries = list(os.scandir(root))
    except OSError:
        return True  # absent or unreadable to us: nothing of ours there
    for e in entries:
        try:
            if e.is_dir(follow_symlinks=False):
                shutil.rmtree(e.path, onerror=_chmod_retry)
            else:
                os.unlink(e.path)
        except OSError:
            ok = False
    return ok


def _chmod_retry(func, path, _exc) -> None:
    os.chmod(os.path.dirname(path), 0o700)
    if os.path.isdir(path) and not os.path.islink(path):
        os.chmod(path, 0o700)
    func(path)


def cleanup() -> bool:
    """Kill leftovers, wipe scratch space; True when the sandbox may still be dirty."""
    global _kernel
    kill_others()
    _kernel = None
    ok = all([_wipe(d) for d in SCRATCH])
    left = others()
    ipc_used = False
    for name in ("shm", "msg", "sem"):
        try:
            with open(f"/proc/sysvipc/{name}") as f:
                ipc_used = ipc_used or len(f.read().splitlines()) > 1
        except OSError:
            pass
    return not ok or bool(left) or ipc_used


def _kernel_proc(mem_mb: int):
    global _kernel
    if _kernel is None or _kernel.poll() is not None:
        os.makedirs(WORK, exist_ok=True)
        _kernel = subprocess.Popen(
            ["/usr/bin/python3", "-u", "-c", KERNEL_SRC, WORK], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, cwd=WORK, env=ENV, start_new_session=True, preexec_fn=_limits(mem_mb),
        )
    return _kernel


def kernel_cell(code: str, timeout: float, cap: int, display: bool, mem_mb: int) -> dict:
    """Run one cell in the persistent kernel; on timeout or crash the kernel (and its state) is gone."""
    global _kernel
    start = time.monotonic()
    kernel = _kernel_proc(mem_mb)
    kernel.stdin.write((json.dumps({"code": code, "cap": cap, "display": display}) + "\n").encode())
    kernel.stdin.flush()
    sel = selectors.DefaultSelector()
    sel.register(kernel.stdout, selectors.EVENT_READ)
    ready = sel.select(timeout if timeout > 0 else None)
    sel.close()
    line = kernel.stdout.readline() if ready else b""
    elapsed = round(time.monotonic() - start, 4)
    if line:
        reply = json.loads(line)
        reply.update(status="Finished", execution_time=elapsed)
        return reply
    timed_out = not ready
    kill_others()
    _kernel = None
    why = "timed out" if timed_out else "died (out of memory or killed)"
    return {"status": "TimeLimitExceeded" if timed_out else "Error", "execution_time": elapsed, "stdout": "",
            "stderr": f"the interpreter {why}; its state was lost and a fresh one starts on the next call",
            "display": [], "error": [{"ename": "KernelDied", "evalue": why, "traceback": []}]}


def op_run(job: dict) -> dict:
    os.makedirs(WORK, exist_ok=True)
    write_files(job.get("files", {}))
    steps, cap = [], int(job["max_output"])
    for step in job["steps"]:
        steps.append(run_step(step, cap))
        if steps[-1]["status"] != "Finished" or steps[-1]["return_code"] != 0:
            break
    files, errors = fetch_files(job.get("fetch_files", []), int(job["max_file"]))
    return {"steps": steps, "files": files, "fetch_errors": errors}


def op_session(job: dict) -> dict:
    os.makedirs(WORK, exist_ok=True)
    write_files(job.get("files", {}))
    cell = kernel_cell(job["code"], float(job["timeout"]), int(job["max_output"]), False, job.get("memory_mb", 0))
    files, errors = fetch_files(job.get("fetch_files", []), int(job["max_file"]))
    return {"cells": [cell], "files": files, "fetch_errors": errors}


def op_jupyter(job: dict) -> dict:
    global _kernel
    if _kernel is not None:  # a notebook always starts from a fresh interpreter
        kill_others()
        _kernel = None
    os.makedirs(WORK, exist_ok=True)
    write_files(job.get("files", {}))
    cells, cap, deadline = [], int(job["max_output"]), time.monotonic() + float(job["total_timeout"])
    for code in job["cells"]:
        left = deadline - time.monotonic()
        per_cell = float(job.get("cell_timeout") or 0)
        limit = min(per_cell, left) if per_cell > 0 else left
        cells.append(kernel_cell(code, max(limit, 0.001), cap, True, job.get("memory_mb", 0)))
        if cells[-1]["status"] != "Finished":
            break
    files, errors = fetch_files(job.get("fetch_files", []), int(job["max_file"]))
    return {"cells": cells, "files": files, "fetch_errors": errors}


OPS = {"run": op_run, "session": op_session, "jupyter": op_jupyter}


def handle(job: dict) -> dict:
    try:
        reply = OPS[job["op"]](job)
    except (ValueError, OSError, KeyError) as e:
        reply = {"error": f"{type(e).__name__}: {e}"}
    keep = job["op"] == "session" and _kernel is not None
    reply["dirty"] = False if keep else cleanup()
    return reply


def main() -> None:
    _nondumpable()
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    ctl_in = os.fdopen(os.dup(0), "rb")
    ctl_out = os.fdopen(os.dup(1), "w")
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    ctl_out.write(json.dumps({"ready": True, "uid": os.getuid(), "pid": os.getpid()}) + "\n")
    ctl_out.flush()
    for line in ctl_in:
        reply = handle(json.loads(line))
        ctl_out.write(json.dumps(reply) + "\n")
        ctl_out.flush()


if __name__ == "__main__":
    main()
