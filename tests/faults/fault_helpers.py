"""Fault injection from outside the run: a watcher thread that fires once a condition holds, and what it fires.

Everything here acts on processes this test session started (Ray workers are children of the
test's own raylet, the sandbox server and CLI drivers are its subprocesses): a process is only
ever signalled after checking it descends from this process.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from verl_agent.trainer.persistence import checkpoint as ckpt

REPO = Path(__file__).resolve().parents[2]

REPORT: list[dict[str, str]] = []  # one row per fault case, printed at the end of the session (conftest.py)


def report(fault: str, outcome: str, exact: str, detect: float | None, resume: float | None) -> None:
    fmt = lambda x: "-" if x is None else f"{x:.1f}"
    REPORT.append({"fault": fault, "outcome": outcome, "exact": exact, "detect": fmt(detect), "resume": fmt(resume)})


# Metrics that are not a function of (seed, step): wall-clock times, the engine's counters (how requests
# happened to share prefill chunks and decode steps; a resumed engine also counts from zero), and the
# engine-vs-actor log-prob gap, which depends on that batching too (float summation order).
NONDETERMINISTIC = ("time/", "perf/", "engine/", "rollout/seconds/", "rollout/actor_logprob_diff")


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def descends_from_us(pid: int) -> bool:
    me = os.getpid()
    try:
        for _ in range(32):
            pid = _parent(pid)
            if pid == me:
                return True
            if pid <= 1:
                return False
    except (OSError, ValueError):
        pass
    return False


def _title(pid: int) -> str:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().split(b"\0")[0].decode(errors="replace")


_workers: dict[str, Any] = {"pids": set(), "scanned": 0.0}  # our TrainWorker pids, rescanned twice a second


def worker_in(method: str) -> int | None:
    """Pid of one of our TrainWorkers while it executes `method` (Ray titles the process `ray::Class.method`).

    Polled every few ms: /proc is scanned for new workers only twice a second (a full scan costs
    ~10 ms on a loaded 2-core machine); in between only the known workers' titles are read.
    """
    if time.monotonic() - _workers["scanned"] > 0.5:
        found = set()
        for entry in os.listdir("/proc"):
            try:
                if entry.isdigit() and _title(int(entry)).startswith("ray::TrainWorker") and descends_from_us(
                        int(entry)):
                    found.add(int(entry))
            except OSError:
                continue
        _workers["pids"], _workers["scanned"] = found, time.monotonic()
    busy = []
    for pid in _workers["pids"]:
        try:
            if _title(pid).startswith(f"ray::TrainWorker.{method}"):
                busy.append(pid)
        except OSError:  # gone
            continue
    return min(busy) if busy else None


def kill9(pid: int) -> None:
    assert descends_from_us(pid), f"refusing to signal {pid}: not started by this test session"
    os.kill(pid, signal.SIGKILL)


def latest_step(run_dir: Path) -> int | None:
    path, _ = ckpt.find_latest(run_dir)
    return int(path.name.rsplit("_", 1)[1]) if path else None


def latest_file(run_dir: Path) -> int | None:
    p = run_dir / ckpt.CKPT_DIR / ckpt.LATEST
    try:
        return int(p.read_text())
    except (OSError, ValueError):
        return None


def metric_lines(run_dir: Path) -> dict[int, dict[str, float]]:
    """Training-step lines of metrics.jsonl by step."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return {}
    out = {}
    for ln in path.read_text().splitlines():
        try:
            d = json.loads(ln)
        except ValueError:  # empty, or being written right now
            continue
        if "rollout/num_trajectories" in d:
            out[d["step"]] = d
    return out


def deterministic(m: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in m.items() if not k.startswith(NONDETERMINISTIC)}


class Fault(threading.Thread):
    """Polls `trigger` every few ms; the first truthy value is passed to `act`, once. `at`: when it fired."""

    def __init__(self, name: str, trigger: Callable[[], Any], act: Callable[[Any], None], poll: float = 0.005):
        super().__init__(name=f"fault:{name}", daemon=True)
        self.trigger, self.act, self.poll = trigger, act, poll
        self.at: float | None = None
        self.error: BaseException | None = None
        self._halt = threading.Event()

    def run(self) -> None:
        try:
            while not self._halt.is_set():
                value = self.trigger()
                if value:
                    self.at = time.monotonic()
                    self.act(value)
                    return
                time.sleep(self.poll)
        except BaseException as e:  # surfaced by __exit__
            self.error = e

    def __enter__(self) -> Fault:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._halt.set()
        self.join(10)
        if self.error is not None:
            raise self.error


class StepClock(threading.Thread):
    """Records when training-step lines appear in metrics.jsonl that were not there, as they are, at the start
    (a resumed run rewrites the lines after its checkpoint): the time to the first step a restart completes."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.t0, self.seen = run_dir, time.monotonic(), {}
        self._halt = threading.Event()
        self._before = metric_lines(run_dir)

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                for step, line in metric_lines(self.run_dir).items():
                    if self._before.get(step) != line and step not in self.seen:
                        self.seen[step] = time.monotonic() - self.t0
            except OSError:  # the file is being rewritten
                pass
            time.sleep(0.05)

    def __enter__(self) -> StepClock:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._halt.set()
        self.join(5)

    def first(self) -> float | None:
        return min(self.seen.values()) if self.seen else None


def fill_disk(mount: Path, leave_bytes: int) -> Path:
    """Write a filler file until the filesystem is full, then give back `leave_bytes` (less than a checkpoint)."""
    filler = mount / "filler.bin"
    chunk = b"\0" * (1 << 20)
    with open(filler, "wb") as f:
        try:
            while True:
                f.write(chunk)
                f.flush()
        except OSError:
            pass
    size = filler.stat().st_size
    os.truncate(filler, max(0, size - leave_bytes))
    return filler


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SandboxServer:
    """`verl-agent sandbox serve --backend process` on a fixed port: killed with SIGKILL and restarted on the same URL."""

    def __init__(self, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 90.0) -> float:
        """Start and wait until /v1/ping answers; returns the seconds it took."""
        t0 = time.monotonic()
        cmd = [sys.executable, "-m", "verl_agent.sandbox.cli", "serve", "--backend", "process", "--port",
               str(self.port), "--pool-size", "2", "--log-level", "warning"]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sandbox server exited with {self.proc.returncode}; see {self.log}")
            try:
                if httpx.get(f"{self.url}/v1/ping", timeout=1).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"sandbox server did not answer within {timeout} s; see {self.log}")

    def kill9(self) -> None:
        """SIGKILL the server, then whatever it had started (its session), as a crash would leave them."""
        assert self.proc is not None
        sid = self.proc.pid  # start_new_session: the server leads its own session
        kill9(self.proc.pid)
        self.proc.wait()
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    if os.getsid(int(entry)) == sid:
                        os.kill(int(entry), signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill9()
