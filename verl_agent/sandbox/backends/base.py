"""A sandbox worker (one live sandbox running the agent) and the warm pool that hands them out.

A backend only says how to start a sandbox (an argv whose stdin/stdout reach the agent) and how to
destroy it. Everything else is shared: the JSON-lines protocol, the server-side hard deadline
(the agent is never trusted to stop on time), and recycling: a worker whose run timed out, whose
agent reported leftovers, that hit ``max_uses``, or that broke the protocol is destroyed and a
fresh one is started in the background; a clean one goes back to the pool for the next run.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Awaitable, Callable
from importlib import resources

logger = logging.getLogger(__name__)

__all__ = ["SandboxBackend", "Worker", "WorkerError", "WorkerPool", "agent_argv"]

WORKDIR = "/tmp/sandbox"
_READ_LIMIT = 256 << 20  # one reply line may carry capped outputs and fetched files


class WorkerError(RuntimeError):
    """The sandbox broke (crashed, hung, spoke garbage); the request gets a SandboxError."""


def agent_argv(python: str = "/usr/bin/python3") -> list[str]:
    """The supervisor's command line. ``-I`` (isolated mode) keeps its working directory (a user-writable
    /tmp) and PYTHON* variables off its import path: ``-c`` alone puts the cwd first on ``sys.path``,
    so a module planted there would run inside the supervisor on its next import."""
    pkg = resources.files("verl_agent.sandbox")
    agent, kernel = (pkg / "agent.py").read_text(), (pkg / "kernel.py").read_text()
    return [python, "-I", "-u", "-c", agent, WORKDIR, kernel]


class Worker:
    """One live sandbox; ``call`` sends a job and waits for its reply, at most ``deadline`` seconds."""

    def __init__(self, name: str, proc: asyncio.subprocess.Process, destroy: Callable[[], Awaitable[None]]):
        self.name, self.proc, self._destroy = name, proc, destroy
        self.uses, self.broken = 0, False

    async def ready(self, timeout: float) -> dict:
        return await self._read(timeout)

    async def call(self, job: dict, deadline: float) -> dict:
        self.uses += 1
        try:
            self.proc.stdin.write((json.dumps(job) + "\n").encode())
            await self.proc.stdin.drain()
        except (ConnectionError, RuntimeError) as e:
            self.broken = True
            raise WorkerError(f"sandbox {self.name} is gone: {e}") from e
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
            stderr=asyncio.subprocess.DEVNULL, limit=_READ_LIMIT, **kwargs,
        )

    @staticmethod
    def new_name(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex[:10]}"


class WorkerPool:
    """``size`` warm workers; acquire never creates a sandbox unless the pool is being refilled."""

    def __init__(self, backend: SandboxBackend, size: int, max_uses: int = 200, spawn_timeout: float = 60.0):
        if size < 1:
            raise ValueError(f"pool size must be >= 1, got {size}")
        self.backend, self.size, self.max_uses, self.spawn_timeout = backend, size, max_uses, spawn_timeout
        self._idle: asyncio.Queue[Worker] = asyncio.Queue()
        self._tasks: set[asyncio.Task] = set()
        self._closed = False
        self.recycled = 0

    async def start(self) -> None:
        await asyncio.gather(*(self._refill() for _ in range(self.size)))

    async def acquire(self) -> Worker:
        return await self._idle.get()

    def try_acquire(self) -> Worker | None:
        """An idle worker at once, or None."""
        try:
            return self._idle.get_nowait()
        except asyncio.QueueEmpty:
            return None

    def idle(self) -> int:
        return self._idle.qsize()

    def release(self, worker: Worker, dirty: bool) -> None:
        if dirty or worker.broken or worker.uses >= self.max_uses or self._closed:
            self.discard(worker)
        else:
            self._idle.put_nowait(worker)

    def discard(self, worker: Worker) -> None:
        """Destroy ``worker`` and start a replacement, both in the background."""
        self.recycled += 1
        self._background(worker.destroy())
        if not self._closed:
            self._background(self._refill())

    def detach(self, worker: Worker) -> None:
        """``worker`` leaves the pool for good (a session owns it now); start a replacement."""
        if not self._closed:
            self._background(self._refill())

    async def _refill(self) -> None:
        delay = 0.5
        while not self._closed:
            try:
                worker = await self.backend.spawn()
                await worker.ready(self.spawn_timeout)
            except (OSError, WorkerError) as e:
                logger.warning("starting a %s sandbox failed (%s); retrying in %.1fs", self.backend.name, e, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)
                continue
            if self._closed:
                await worker.destroy()
            else:
                self._idle.put_nowait(worker)
            return

    def _background(self, coro: Awaitable) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        self._closed = True
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        workers = []
        while not self._idle.empty():
            workers.append(self._idle.get_nowait())
        await asyncio.gather(*(w.destroy() for w in workers), return_exceptions=True)
