"""A sandbox worker (one live sandbox running the agent) and the warm pool that hands them out.

A backend only says how to start a sandbox (something whose stdin/stdout reach the agent: a process,
or a container attached over the Docker API) and how to destroy it. Everything else is shared: the
JSON-lines protocol, the server-side hard deadline (the agent is never trusted to stop on time), and
recycling: a worker whose agent reported it may
be dirty (a process survived the kill, scratch space not wiped, SysV IPC in use), that hit
``max_uses``, or that broke the protocol or the server-side deadline is destroyed (a replacement
starts in the background when the pool needs one); a clean one goes back to the pool for the next
run. A run that timed out is clean once the agent has killed every other process and wiped the
scratch space, exactly as after a run that exited: its sandbox is reused, so timeouts under load
do not turn into a stream of container starts.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import tempfile
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Protocol

logger = logging.getLogger(__name__)

__all__ = ["READ_LIMIT", "AgentProcess", "SandboxBackend", "Worker", "WorkerError", "WorkerPool", "agent_argv"]

WORKDIR = "/tmp/sandbox"
READ_LIMIT = 256 << 20  # one reply line may carry capped outputs and fetched files
SPAWN_PARALLEL = 4  # sandboxes started at once by one pool


class WorkerError(RuntimeError):
    """The sandbox broke (crashed, hung, spoke garbage); the request gets a SandboxError."""


# Test-only (probe.WEAKENINGS): a weakening of the supervisor or the kernel is a change of their source, each
# (file, text, its replacement everywhere). A layered guarantee loses every layer at once.
_KILL_GROUP_ONLY = ("def kill_others() -> None:\n"
                    "    for pid in PROTECT:  # weakened: the program's process group only, nothing reaped\n"
                    "        try:\n            os.killpg(pid, signal.SIGKILL)\n"
                    "        except OSError:\n            pass\n    return\n")
SOURCE_WEAKENINGS: dict[str, list[tuple[str, str, str]]] = {
    # the wipe of the scratch dirs after a run does nothing
    "scratch_wipe": [("agent", "def _wipe(root: str) -> bool:\n", "def _wipe(root: str) -> bool:\n    return True\n")],
    # a process a notebook cell forks goes on as the kernel
    "fork_guard": [("kernel", "if os.getpid() != KERNEL_PID:", "if False:")],
    # after a run only the program's process group is killed; orphans are neither reaped nor reported
    "no_leftover_processes": [("agent", "def kill_others() -> None:\n", _KILL_GROUP_ONLY),
                              ("agent", "return not ok or bool(left) or ipc_used", "return not ok or ipc_used")],
    # the supervisor stays dumpable and every program gets its environment (with clean_env's host variables)
    "no_host_env": [("agent", "    _nondumpable()\n", ""), ("agent", "ENV = {", "ENV = {**os.environ, ")],
    # the supervisor's check that a request's paths stay inside the work dir (the server's: service.py)
    "paths_confined": [("agent", "def _inside(path: str) -> str:\n",
                        "def _inside(path: str) -> str:\n    return os.path.normpath(os.path.join(WORK, path))\n")],
    # request files are written and fetched through symlinks: no realpath check, no O_NOFOLLOW
    "no_symlink_follow": [
        ("agent", "if os.path.realpath(os.path.dirname(full)) != os.path.dirname(full):", "if False:"),
        ("agent", "if os.path.realpath(full) != full:", "if False:"),
        ("agent", "os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW", "os.O_WRONLY | os.O_CREAT | os.O_TRUNC"),
        ("agent", "os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK", "os.O_RDONLY | os.O_NONBLOCK")],
}


def agent_argv(python: str = "/usr/bin/python3", weaken: frozenset[str] = frozenset()) -> list[str]:
    """The supervisor's command line. ``-I`` (isolated mode) keeps its working directory (a user-writable
    /tmp) and PYTHON* variables off its import path: ``-c`` alone puts the cwd first on ``sys.path``,
    so a module planted there would run inside the supervisor on its next import. ``weaken``
    (test-only, probe.WEAKENINGS): ``isolated_mode`` drops ``-I``; the names in ``SOURCE_WEAKENINGS``
    change the supervisor's or the kernel's source."""
    pkg = resources.files("verl_agent.sandbox")
    source = {"agent": (pkg / "agent.py").read_text(), "kernel": (pkg / "kernel.py").read_text()}
    flags = ["-u"] if "isolated_mode" in weaken else ["-I", "-u"]
    for name in sorted(weaken & SOURCE_WEAKENINGS.keys()):
        for part, text, replacement in SOURCE_WEAKENINGS[name]:
            if text not in source[part]:
                raise ValueError(f"weaken={name}: {part}.py does not hold {text!r}")
            source[part] = source[part].replace(text, replacement)
    return [python, *flags, "-c", source["agent"], WORKDIR, source["kernel"]]


def shared_tmp(weaken: frozenset[str]) -> str | None:
    """Test-only (probe.WEAKENINGS): with ``private_tmp`` weakened, the one host directory every sandbox of
    a backend gets as its /tmp and /var/tmp (world-writable, sticky); else None."""
    if "private_tmp" not in weaken:
        return None
    path = tempfile.mkdtemp(prefix="verl-sbx-shared-")
    os.chmod(path, 0o1777)
    return path


def weakened_job(job: dict, weaken: frozenset[str]) -> dict:
    """Test-only (probe.WEAKENINGS): ``job`` with the run limits named in ``weaken`` lifted (bounded: time
    limits x1000, the output cap to 16 MiB), as a sandbox ignoring them would run it."""
    job = json.loads(json.dumps(job))
    parts = [job, *job.get("steps", [])]
    for part in parts:
        if "run_timeout" in weaken:
            for key in ("timeout", "cell_timeout", "total_timeout"):
                if part.get(key):
                    part[key] *= 1000
        if "run_memory_limit" in weaken and "memory_mb" in part:
            part["memory_mb"] = 0
    if "output_cap" in weaken and "max_output" in job:
        job["max_output"] = 16 << 20
    return job


class AgentProcess(Protocol):
    """What a Worker needs of its agent: an ``asyncio.subprocess.Process`` has it all."""

    stdin: asyncio.StreamWriter
    stdout: asyncio.StreamReader
    returncode: int | None

    async def wait(self) -> int: ...

    def kill(self) -> None: ...


class Worker:
    """One live sandbox; ``call`` sends a job and waits for its reply, at most ``deadline`` seconds."""

    def __init__(self, name: str, proc: AgentProcess, destroy: Callable[[], Awaitable[None]],
                 on_ready: Callable[[], Awaitable[None]] | None = None, weaken: frozenset[str] = frozenset()):
        self.name, self.proc, self._destroy, self._on_ready = name, proc, destroy, on_ready
        self.uses, self.broken = 0, False
        self.weaken = weaken & {"run_timeout", "run_memory_limit", "output_cap"}  # test-only: see weakened_job

    async def ready(self, timeout: float) -> dict:
        """The agent's hello, once it has started; then the backend's ``on_ready`` step, if any."""
        hello = await self._read(timeout)
        if self._on_ready is not None:
            await self._on_ready()
        return hello

    async def call(self, job: dict, deadline: float) -> dict:
        self.uses += 1
        if self.weaken:
            job = weakened_job(job, self.weaken)
        try:
            self.proc.stdin.write((json.dumps(job) + "\n").encode())
            await self.proc.stdin.drain()
        except (ConnectionError, RuntimeError) as e:
            self.broken = True
            raise WorkerError(f"sandbox {self.name} is gone (agent exited with {await self._rc()}): {e}") from e
        return await self._read(deadline)

    async def _read(self, timeout: float) -> dict:
        try:
            line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        except asyncio.TimeoutError as e:
            self.broken = True
            raise WorkerError(f"sandbox {self.name} did not answer within {timeout:.1f}s (killed)") from e
        except (ValueError, asyncio.LimitOverrunError) as e:
            self.broken = True
            raise WorkerError(f"sandbox {self.name} sent an oversized reply") from e
        if not line:
            self.broken = True
            raise WorkerError(f"sandbox {self.name} crashed (agent exited with {await self._rc()})")
        try:
            return json.loads(line)
        except json.JSONDecodeError as e:
            self.broken = True
            raise WorkerError(f"sandbox {self.name} sent garbage") from e

    async def _rc(self) -> int | None:
        try:
            return await asyncio.wait_for(self.proc.wait(), 1.0)
        except asyncio.TimeoutError:
            return None

    async def destroy(self) -> None:
        try:
            await self._destroy()
        finally:
            if self.proc.returncode is None:
                self.proc.kill()
            await self.proc.wait()


class SandboxBackend:
    """Backend interface: ``spawn`` starts one sandbox running ``agent_argv()`` and returns a Worker."""

    name = "base"
    weaken: frozenset[str] = frozenset()  # test-only (probe.WEAKENINGS): the protections this one lacks

    async def spawn(self) -> Worker:
        raise NotImplementedError

    def guarantees(self) -> dict[str, bool]:
        """Which isolation properties hold on this host (the server logs them at startup)."""
        raise NotImplementedError

    def languages(self) -> list[str]:
        raise NotImplementedError

    async def close(self) -> None:
        """Remove anything the backend left behind (containers, cgroups)."""

    @staticmethod
    async def start_process(argv: list[str], **kwargs) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL, limit=READ_LIMIT, **kwargs,
        )

    @staticmethod
    def new_name(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex[:10]}"


class WorkerPool:
    """An elastic pool: ``min_size`` warm workers always, grown on demand up to ``max_size``.

    ``acquire`` takes the idle worker that has rested longest (round robin: a sandbox just used still
    has the kernel's clean-up of its last run to do, and a fresh one answers a few ms sooner) or, when
    none is idle, waits in FIFO order for the first worker that frees up or is started for it: each
    waiter beyond the workers already starting starts one more sandbox while the pool is below
    ``max_size``. The pool shrinks to the demand it saw: every ``idle_timeout`` seconds' peak of
    busy + waiting requests (never below ``min_size``); the workers beyond it are destroyed. A
    destroyed worker (dirty, broken, worn out) is replaced only to keep ``min_size`` or to serve a
    waiter, so a burst grows the pool and a quiet period shrinks it back.
    """

    def __init__(self, backend: SandboxBackend, min_size: int, max_size: int | None = None,
                 idle_timeout: float = 60.0, max_uses: int = 200, spawn_timeout: float = 60.0):
        max_size = max(min_size, 1) if max_size is None else max_size
        if min_size < 0 or max_size < 1 or max_size < min_size:
            raise ValueError(f"sandbox pool: need 0 <= min_pool_size <= max_pool_size and max_pool_size >= 1, "
                             f"got min_pool_size={min_size}, max_pool_size={max_size}")
        if idle_timeout <= 0:
            raise ValueError(f"sandbox pool: pool_idle_timeout must be > 0 seconds, got {idle_timeout}")
        self.backend, self.min_size, self.max_size = backend, min_size, max_size
        self.idle_timeout, self.max_uses, self.spawn_timeout = idle_timeout, max_uses, spawn_timeout
        self._idle: deque[tuple[Worker, float]] = deque()  # (worker, idle since); right end = most recent
        self._waiters: deque[asyncio.Future] = deque()
        self._busy = self._starting = 0
        self._spawn_slots = asyncio.Semaphore(SPAWN_PARALLEL)
        self._tasks: set[asyncio.Task] = set()
        self._closed = False
        self.recycled = self.spawned = self.shrunk = 0
        self.peak = 0
        self._tick = min(max(idle_timeout / 4, 0.05), 5.0)
        self._demand = 0  # peak busy + waiting since the last shrink tick
        self._window: deque[int] = deque(maxlen=max(1, round(idle_timeout / self._tick)))

    async def start(self) -> None:
        self._starting += self.min_size
        self.peak = self.total()
        await asyncio.gather(*(self._spawn() for _ in range(self.min_size)))
        self._background(self._shrink_loop())

    # -- sizes ----------------------------------------------------------------------------------------
    def idle(self) -> int:
        return len(self._idle)

    def waiting(self) -> int:
        return sum(not f.done() for f in self._waiters)

    def total(self) -> int:
        """Workers owned by the pool: idle + running a request + starting."""
        return len(self._idle) + self._busy + self._starting

    def stats(self) -> dict:
        return {"idle": len(self._idle), "busy": self._busy, "starting": self._starting, "waiting": self.waiting(),
                "total": self.total(), "peak": self.peak, "min_pool_size": self.min_size,
                "max_pool_size": self.max_size, "spawned": self.spawned, "recycled": self.recycled,
                "shrunk": self.shrunk}

    # -- taking and giving back -----------------------------------------------------------------------
    def try_acquire(self) -> Worker | None:
        """An idle worker at once, or None."""
        if not self._idle:
            return None
        self._busy += 1
        self._note_demand()
        return self._idle.popleft()[0]

    def _note_demand(self) -> None:
        self._demand = max(self._demand, self._busy + self.waiting())

    async def acquire(self, timeout: float | None = None) -> Worker:
        """The next free worker (growing the pool if allowed); ``asyncio.TimeoutError`` after ``timeout`` s."""
        worker = self.try_acquire()
        if worker is not None:
            return worker
        if self._closed:
            raise WorkerError("the sandbox pool is shut down")
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        self._note_demand()
        self._grow()
        try:
            await asyncio.wait({fut}, timeout=timeout)
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # a worker was handed over as we were cancelled
                self._busy -= 1
                self._give(fut.result())
            self._abandon(fut)
            raise
        if fut.done() and not fut.cancelled():
            return fut.result()
        self._abandon(fut)
        raise asyncio.TimeoutError

    def _abandon(self, fut: asyncio.Future) -> None:
        fut.cancel()
        try:
            self._waiters.remove(fut)
        except ValueError:
            pass

    def release(self, worker: Worker, dirty: bool) -> None:
        """A request is done with ``worker``: back to the pool, or destroyed when it may hold leftovers."""
        if dirty or worker.broken or worker.uses >= self.max_uses or self._closed:
            self.discard(worker)
        else:
            self._busy -= 1
            self._give(worker)

    def discard(self, worker: Worker) -> None:
        """Destroy ``worker`` (in the background) and start a replacement if one is needed."""
        self._busy -= 1
        self.recycled += 1
        self._background(worker.destroy())
        self._replenish()

    def detach(self, worker: Worker) -> None:
        """``worker`` leaves the pool for good (a session owns it now); keep the warm minimum."""
        self._busy -= 1
        self._replenish()

    def _give(self, worker: Worker) -> None:
        """Hand ``worker`` to the first live waiter, else park it idle."""
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                self._busy += 1
                fut.set_result(worker)
                return
        self._idle.append((worker, time.monotonic()))

    # -- growing and shrinking ------------------------------------------------------------------------
    def _replenish(self) -> None:
        if self._closed:
            return
        short = self.min_size - self.total()
        for _ in range(max(short, 0)):
            self._start_one()
        self._grow()

    def _grow(self) -> None:
        """One new sandbox per waiter not already covered by a starting one, up to ``max_size``."""
        need = min(self.waiting() - self._starting, self.max_size - self.total())
        for _ in range(max(need, 0)):
            self._start_one()

    def _start_one(self) -> None:
        self._starting += 1
        self.peak = max(self.peak, self.total())
        self._background(self._spawn())

    async def _spawn(self) -> None:
        """Start one sandbox (retrying with back-off while the backend fails) and give it out.

        At most ``SPAWN_PARALLEL`` start at once: container starts share the CPU with the runs, and
        in a burst the first sandboxes come up sooner one batch at a time than all together. A start
        is not dropped when its waiter was served by a freed sandbox meanwhile: the pool keeps the
        size the burst asked for until ``idle_timeout`` says the load is gone."""
        worker = None
        try:
            async with self._spawn_slots:
                worker = await self._start_worker()
        finally:
            self._starting -= 1
        if worker is None:
            return
        self.spawned += 1
        if self._closed:
            await worker.destroy()
        else:
            self._give(worker)

    async def _start_worker(self) -> Worker | None:
        """One ready sandbox; retried with back-off while the backend fails (None once closed)."""
        delay, worker = 0.5, None
        while worker is None and not self._closed:
            try:
                worker = await self.backend.spawn()
                await worker.ready(self.spawn_timeout)
            except (OSError, WorkerError) as e:
                if worker is not None:
                    await worker.destroy()
                    worker = None
                logger.warning("starting a %s sandbox failed (%s); retrying in %.1fs", self.backend.name, e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)
            except BaseException:
                if worker is not None:
                    await asyncio.shield(worker.destroy())
                raise
        return worker

    async def _shrink_loop(self) -> None:
        while not self._closed:
            await asyncio.sleep(self._tick)
            self.shrink()

    def shrink(self) -> int:
        """Destroy idle workers beyond the last ``idle_timeout`` seconds' peak demand (not below ``min_size``)."""
        self._window.append(self._demand)
        self._demand = self._busy + self.waiting()
        keep = max(self.min_size, max(self._window))
        removed = 0
        while self._idle and self.total() > keep:
            worker, _ = self._idle.pop()  # the most recently used: the others stay in rotation
            self._background(worker.destroy())
            removed += 1
        self.shrunk += removed
        return removed

    def _background(self, coro: Awaitable) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        self._closed = True
        for fut in self._waiters:
            fut.cancel()
        self._waiters.clear()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        workers = [w for w, _ in self._idle]
        self._idle.clear()
        await asyncio.gather(*(w.destroy() for w in workers), return_exceptions=True)
