"""Stateful sessions (our extension to Sandbox Fusion's API): one live interpreter per session id.

Session ids are issued by the server, never chosen by the client: ``open`` returns a fresh
unguessable token (256 random bits, ``secrets``), and a call naming any other id is refused. So a
client cannot attach to, run code in, or close another client's session unless that client handed
it its id. Issued ids count against ``max_sessions`` from the moment they are issued; one more is
refused with a clear message (close one, or wait for idle ones to expire).

A session's worker is taken from the warm pool on the session's first call (the pool starts a
replacement) and kept until ``close``, ``idle_timeout`` seconds without a call, or server shutdown;
then the worker is destroyed, never reused. Calls to one session run one at a time, in arrival
order. If the session's sandbox breaks, its state is lost and the call answers an error; the id
stays valid and the next call starts a fresh interpreter.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from verl_agent.sandbox.backends.base import Worker, WorkerError, WorkerPool

logger = logging.getLogger(__name__)

__all__ = ["SessionError", "SessionManager", "UnknownSession"]


class SessionError(RuntimeError):
    """The session could not be opened or its sandbox broke (answered as SandboxError)."""


class UnknownSession(SessionError):
    """The id was not issued by this server, or its session was closed or expired."""


@dataclass
class _Session:
    worker: Worker | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_used: float = field(default_factory=time.monotonic)


def _short(sid: str) -> str:
    return sid[:6] + "..."  # never log a whole token: logs are readable by more people than the API


class SessionManager:
    def __init__(self, pool: WorkerPool, max_sessions: int, idle_timeout: float):
        self.pool, self.max_sessions, self.idle_timeout = pool, max_sessions, idle_timeout
        self._sessions: dict[str, _Session] = {}
        self._reaper: asyncio.Task | None = None

    def start(self) -> None:
        self._reaper = asyncio.ensure_future(self._reap_idle())

    def __len__(self) -> int:
        return len(self._sessions)

    def open(self) -> str:
        """Issue a new session id (no sandbox is taken until its first call)."""
        if len(self._sessions) >= self.max_sessions:
            raise SessionError(f"too many open sessions (max {self.max_sessions}); close one first")
        sid = secrets.token_urlsafe(32)
        self._sessions[sid] = _Session()
        logger.info("session %s issued", _short(sid))
        return sid

    async def call(self, sid: str, job: dict, deadline: float, acquire: Callable[[], Awaitable[Worker]]) -> dict:
        session = self._sessions.get(sid)
        if session is None:
            raise UnknownSession("unknown session_id (not issued by this server, closed, or expired); "
                                 "get one from POST /open_session")
        async with session.lock:
            session.last_used = time.monotonic()
            if session.worker is None:
                worker = await acquire()
                self.pool.detach(worker)
                if self._sessions.get(sid) is not session:  # closed while we waited for a worker
                    await worker.destroy()
                    raise UnknownSession("the session was closed while its call waited for a sandbox")
                session.worker = worker
            try:
                reply = await session.worker.call(job, deadline)
            except WorkerError as e:
                broken, session.worker = session.worker, None
                await broken.destroy()
                raise SessionError(f"session sandbox failed: {e}; its state was lost, the next call starts "
                                   f"a fresh interpreter") from e
            session.last_used = time.monotonic()
            return reply

    async def close(self, sid: str) -> bool:
        session = self._sessions.pop(sid, None)
        if session is None:
            return False
        if session.worker is not None:
            await session.worker.destroy()
        logger.info("session %s closed", _short(sid))
        return True

    async def _reap_idle(self) -> None:
        while True:
            await asyncio.sleep(max(min(self.idle_timeout / 4, 30.0), 0.05))
            now = time.monotonic()
            for sid, s in list(self._sessions.items()):
                if now - s.last_used > self.idle_timeout and not s.lock.locked():
                    logger.info("session %s idle for %.0fs; closing", _short(sid), now - s.last_used)
                    await self.close(sid)

    async def close_all(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        await asyncio.gather(*(self.close(sid) for sid in list(self._sessions)), return_exceptions=True)
