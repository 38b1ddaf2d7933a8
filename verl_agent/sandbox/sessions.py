"""Stateful sessions (our extension to Sandbox Fusion's API): one live interpreter per ``session_id``.

A session takes a worker out of the warm pool for good (the pool starts a replacement) and keeps
it until ``close``, ``idle_timeout`` seconds without a call, or server shutdown; then the worker is
destroyed, never reused. Calls to one session run one at a time, in arrival order. At most
``max_sessions`` are open; one more is refused with a clear message (close one, or wait for idle
ones to expire).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from verl_agent.sandbox.backends.base import Worker, WorkerError, WorkerPool

logger = logging.getLogger(__name__)

__all__ = ["SessionError", "SessionManager"]


class SessionError(RuntimeError):
    """The session could not be opened or its sandbox broke (answered as SandboxError)."""


@dataclass
class _Session:
    worker: Worker
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_used: float = field(default_factory=time.monotonic)


class SessionManager:
    def __init__(self, pool: WorkerPool, max_sessions: int, idle_timeout: float):
        self.pool, self.max_sessions, self.idle_timeout = pool, max_sessions, idle_timeout
        self._sessions: dict[str, _Session] = {}
        self._opening: dict[str, asyncio.Lock] = {}
        self._reaper: asyncio.Task | None = None

    def start(self) -> None:
        self._reaper = asyncio.ensure_future(self._reap_idle())

    def __len__(self) -> int:
        return len(self._sessions)

    async def _open(self, sid: str, acquire: Callable[[], Awaitable[Worker]]) -> _Session:
        lock = self._opening.setdefault(sid, asyncio.Lock())
        async with lock:  # two first calls of one session race: only one opens it
            if sid in self._sessions:
                return self._sessions[sid]
            if len(self._sessions) >= self.max_sessions:
                raise SessionError(f"too many open sessions (max {self.max_sessions}); close one first")
            worker = await acquire()
            self.pool.detach(worker)
            self._sessions[sid] = _Session(worker)
            logger.info("session %s opened on %s", sid, worker.name)
            return self._sessions[sid]

    async def call(self, sid: str, job: dict, deadline: float, acquire: Callable[[], Awaitable[Worker]]) -> dict:
        session = self._sessions.get(sid) or await self._open(sid, acquire)
        async with session.lock:
            session.last_used = time.monotonic()
            try:
                reply = await session.worker.call(job, deadline)
            except WorkerError as e:
                await self.close(sid)
                raise SessionError(f"session {sid}: {e}; the session was closed") from e
            session.last_used = time.monotonic()
            return reply

    async def close(self, sid: str) -> bool:
        session = self._sessions.pop(sid, None)
        self._opening.pop(sid, None)
        if session is None:
            return False
        await session.worker.destroy()
        logger.info("session %s closed", sid)
        return True

    async def _reap_idle(self) -> None:
        while True:
            await asyncio.sleep(max(min(self.idle_timeout / 4, 30.0), 0.05))
            now = time.monotonic()
            for sid, s in list(self._sessions.items()):
                if now - s.last_used > self.idle_timeout and not s.lock.locked():
                    logger.info("session %s idle for %.0fs; closing", sid, now - s.last_used)
                    await self.close(sid)

    async def close_all(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        await asyncio.gather(*(self.close(sid) for sid in list(self._sessions)), return_exceptions=True)
