"""The sandbox service: turns API requests into agent jobs on pooled workers, and back.

Pool: ``min_pool_size`` warm sandboxes always; when every one is busy the pool starts more, one per
waiting request, up to ``max_pool_size``, and destroys those beyond the peak demand of the last
``pool_idle_timeout`` seconds, down to the minimum again. Concurrent runs share the CPU (each
sandbox has a CPU quota of its own, no pinning), so a burst of runs time out on their own wall-clock
deadlines instead of queueing.

Admission: at most ``max_queue`` requests wait for a worker; beyond that, or after ``queue_timeout``
seconds of waiting, a request fails fast with ``Overloaded`` (HTTP 503 + Retry-After; clients
retry). A retried request (``SandboxClient`` marks it with the ``X-Sandbox-Retry`` header) may also
take one of a second ``max_queue`` waiting slots: closed-loop clients refill a freed slot the moment
they are answered, and without this reserve a client that got a 503 could lose that race again and
again. A worker that crashes or hangs past the server-side deadline is destroyed and replaced, and
its request answers ``SandboxError``: never lost silently, never a 500. A client that keeps breaking
its sandbox is slowed down on its own (`CrashBackoff`). Every response carries ``queue_time``: the
seconds it waited for a sandbox (the back-off included), apart from the run's own ``execution_time``.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import posixpath
import time
from collections import deque
from dataclasses import dataclass

from verl_agent.sandbox.api import (
    DEFAULT_MEMORY_MB,
    CommandRunResult, RunCodeRequest, RunCodeResponse, RunJupyterRequest, RunJupyterResponse, RunStatus,
)
from verl_agent.sandbox.backends.base import WORKDIR, SandboxBackend, Worker, WorkerError, WorkerPool
from verl_agent.sandbox.languages import LANGUAGES
from verl_agent.sandbox.sessions import SessionError, SessionManager

logger = logging.getLogger(__name__)

__all__ = ["Overloaded", "SandboxService", "ServiceSettings"]

GRACE_S = 5.0  # server-side deadline = the request's timeouts + this


class Overloaded(RuntimeError):
    """Too many requests waiting; answered with HTTP 503 and Retry-After (retryable)."""


@dataclass
class ServiceSettings:
    """Server settings (CLI: ``verl-agent sandbox serve --min-pool-size ... --max-pool-size ...``)."""

    min_pool_size: int = 4  # warm sandboxes kept ready at all times (0: start each one on demand)
    max_pool_size: int = 32  # the pool grows on demand up to this many sandboxes running at once
    pool_idle_timeout: float = 60.0  # shrink to the peak demand of the last this-many seconds (>= min_pool_size)
    max_queue: int = 64
    queue_timeout: float = 30.0
    max_output_bytes: int = 1 << 20  # per stream; the rest is drained and replaced by a marker
    max_file_bytes: int = 16 << 20
    default_memory_mb: int = DEFAULT_MEMORY_MB
    max_memory_mb: int = DEFAULT_MEMORY_MB
    max_uses: int = 200
    crash_respawn_rate: float = 1.0  # a client in a crash loop gets a sandbox at most this many times a second
    crash_respawn_burst: int = 8  # breaks a client may cause at full speed before its back-off starts
    max_sessions: int = 32
    session_idle_timeout: float = 300.0

    def __post_init__(self) -> None:
        if not 0 <= self.min_pool_size <= self.max_pool_size or self.max_pool_size < 1:
            raise ValueError(f"sandbox settings: need 0 <= min_pool_size <= max_pool_size and max_pool_size >= 1, "
                             f"got min_pool_size={self.min_pool_size}, max_pool_size={self.max_pool_size}")
        for name in ("pool_idle_timeout", "queue_timeout", "session_idle_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"sandbox settings: {name} must be > 0 seconds, got {getattr(self, name)}")
        if not self.crash_respawn_rate > 0:
            raise ValueError(f"sandbox settings: crash_respawn_rate must be > 0 per second, "
                             f"got {self.crash_respawn_rate}")
        for name, low in (("max_queue", 0), ("max_sessions", 0), ("max_output_bytes", 1), ("max_file_bytes", 1),
                          ("default_memory_mb", 1), ("max_memory_mb", 1), ("max_uses", 1),
                          ("crash_respawn_burst", 0)):
            if getattr(self, name) < low:
                raise ValueError(f"sandbox settings: {name} must be >= {low}, got {getattr(self, name)}")


class CrashBackoff:
    """Per-client crash-loop back-off.

    Replacing a sandbox that broke (its agent was killed, hung or spoke garbage) costs a container
    start; a client that breaks its sandbox over and over would take the host's CPU from everyone
    else's runs with those starts. A client may cause ``burst`` breaks within ``burst / rate`` seconds
    at full speed; beyond that its new requests wait until ``1 / rate`` seconds after its last break,
    so its replacements run at about ``rate`` per second. It is a pause, not a queue: runs already in
    flight go on, and the requests that waited start together. Other clients are not delayed.
    """

    def __init__(self, rate: float, burst: int):
        self.rate, self.burst = rate, burst
        self.window = burst / rate
        self._breaks: dict[str, deque[float]] = {}
        self.delayed = 0

    def note(self, client: str) -> None:
        now = time.monotonic()
        if len(self._breaks) > 1024:  # forget clients whose breaks are old
            self._breaks = {c: d for c, d in self._breaks.items() if now - d[-1] < self.window}
        self._breaks.setdefault(client, deque(maxlen=self.burst + 1)).append(now)

    def delay(self, client: str) -> float:
        """Seconds ``client`` must wait before its next request gets a sandbox (0 outside a crash loop)."""
        breaks = self._breaks.get(client)
        if breaks is None or len(breaks) <= self.burst:
            return 0.0
        now = time.monotonic()
        if now - breaks[0] >= self.window:
            return 0.0
        return max(0.0, breaks[-1] + 1 / self.rate - now)


def _rel_path(path: str, field: str) -> str:
    """Lexical check (the agent re-checks against symlinks): paths must stay inside the work dir."""
    if not path or "\0" in path:
        raise ValueError(f"{field}: empty path or NUL byte in {path!r}")
    if path.startswith("/"):
        if not path.startswith(WORKDIR + "/"):
            raise ValueError(f"{field}: absolute path {path!r} is outside the work directory {WORKDIR}")
        path = path[len(WORKDIR) + 1:]
    norm = posixpath.normpath(path)
    if norm in (".", "..") or norm.startswith("../"):
        raise ValueError(f"{field}: path {path!r} escapes the work directory")
    return norm


def _result(step: dict | None) -> CommandRunResult | None:
    return None if step is None else CommandRunResult(**step)


class SandboxService:
    def __init__(self, backend: SandboxBackend, settings: ServiceSettings | None = None):
        self.backend, self.settings = backend, settings or ServiceSettings()
        s = self.settings
        self.pool = WorkerPool(backend, s.min_pool_size, s.max_pool_size, idle_timeout=s.pool_idle_timeout,
                               max_uses=s.max_uses)
        self.sessions = SessionManager(self.pool, s.max_sessions, s.session_idle_timeout)
        self.backoff = CrashBackoff(s.crash_respawn_rate, s.crash_respawn_burst)
        self.languages = set(backend.languages())
        self.stats = {"runs": 0, "sandbox_errors": 0, "overloaded": 0}

    async def start(self) -> None:
        t0 = time.monotonic()
        await self.pool.start()
        self.sessions.start()
        logger.info("sandbox backend %r: %d warm workers (up to %d on demand) in %.1fs; guarantees: %s",
                    self.backend.name, self.settings.min_pool_size, self.settings.max_pool_size,
                    time.monotonic() - t0, self.backend.guarantees())

    async def close(self) -> None:
        await self.sessions.close_all()
        await self.pool.close()
        await self.backend.close()

    async def _acquire(self, retried: bool = False) -> tuple[Worker, float]:
        """A worker and the seconds waited for it; ``Overloaded`` when the queue is full or too slow."""
        worker = self.pool.try_acquire()
        if worker is not None:
            return worker, 0.0
        if self.pool.waiting() >= self.settings.max_queue * (2 if retried else 1):
            self.stats["overloaded"] += 1
            raise Overloaded(f"{self.pool.waiting()} requests already waiting for a sandbox; retry later")
        t0 = time.monotonic()
        try:
            worker = await self.pool.acquire(self.settings.queue_timeout)
        except asyncio.TimeoutError as e:
            self.stats["overloaded"] += 1
            raise Overloaded(f"no sandbox free within {self.settings.queue_timeout:.0f}s; retry later") from e
        except WorkerError as e:  # shutting down
            raise Overloaded(str(e)) from e
        return worker, round(time.monotonic() - t0, 4)

    async def _session_worker(self) -> Worker:
        return (await self._acquire())[0]

    async def _call(self, job: dict, deadline: float, retried: bool = False,
                    client: str = "") -> tuple[dict | None, str, str | None, float]:
        """Run ``job`` on a pooled worker for ``client``: (reply, error message, worker name, seconds waited
        for the worker, the crash-loop back-off included)."""
        backoff = self.backoff.delay(client)
        if backoff > 0:
            self.backoff.delayed += 1
            await asyncio.sleep(backoff)
        worker, waited = await self._acquire(retried)
        waited = round(waited + backoff, 4)
        try:
            reply = await worker.call(job, deadline)
        except WorkerError as e:
            self.backoff.note(client)
            self.pool.discard(worker)
            self.stats["sandbox_errors"] += 1
            logger.warning("%s; replaced", e)
            return None, f"{e}; the sandbox was replaced", worker.name, waited
        except BaseException:
            self.pool.discard(worker)  # cancelled mid-run: state unknown
            raise
        # A timed-out run is as clean as a finished one once the agent has killed everything and
        # wiped scratch (it says ``dirty`` otherwise), so the sandbox is reused either way.
        self.pool.release(worker, bool(reply.get("dirty")))
        return reply, "", worker.name, waited

    def _path(self, path: str, field: str) -> str:
        """A request's path, checked to stay inside the work dir (not with the test-only paths_confined weakening)."""
        return path if "paths_confined" in self.backend.weaken else _rel_path(path, field)

    def _job(self, req: RunCodeRequest) -> tuple[dict, float]:
        lang = LANGUAGES[req.language]
        files = {self._path(p, "files"): (b or "") for p, b in req.files.items()}
        files[lang.source] = base64.b64encode(req.code.encode()).decode()
        mem = req.memory_limit_MB if req.memory_limit_MB > 0 else self.settings.default_memory_mb
        mem = min(mem, self.settings.max_memory_mb) if lang.address_limit else 0
        steps = []
        if lang.compile:
            steps.append({"argv": lang.compile, "timeout": req.compile_timeout, "memory_mb": 0})
        steps.append({"argv": lang.run, "timeout": req.run_timeout, "stdin": req.stdin, "memory_mb": mem})
        job = {"op": "run", "files": files, "steps": steps, "memory_mb": mem,
               "fetch_files": [self._path(p, "fetch_files") for p in req.fetch_files],
               "max_output": self.settings.max_output_bytes, "max_file": self.settings.max_file_bytes}
        deadline = req.run_timeout + (req.compile_timeout if lang.compile else 0) + GRACE_S
        return job, deadline

    async def run_code(self, req: RunCodeRequest, retried: bool = False, client: str = "") -> RunCodeResponse:
        self.stats["runs"] += 1
        if req.language not in LANGUAGES or req.language not in self.languages:
            known = ", ".join(sorted(self.languages))
            return RunCodeResponse(status=RunStatus.SandboxError,
                                   message=f"unknown language {req.language!r}; this sandbox runs: {known}")
        try:
            job, deadline = self._job(req)
        except ValueError as e:
            return RunCodeResponse(status=RunStatus.Failed, message=str(e))
        if req.session_id is not None:
            return await self._session_run(req, job, deadline)
        reply, error, name, waited = await self._call(job, deadline, retried, client)
        if reply is None:
            return RunCodeResponse(status=RunStatus.SandboxError, message=error, executor_pod_name=name,
                                   queue_time=waited)
        if "error" in reply:
            return RunCodeResponse(status=RunStatus.Failed, message=reply["error"], executor_pod_name=name,
                                   queue_time=waited)
        steps = reply["steps"]
        compiled = LANGUAGES[req.language].compile is not None
        compile_step, run_step = (steps[0], steps[1] if len(steps) > 1 else None) if compiled else (None, steps[0])
        ok = all(s["status"] == "Finished" and s["return_code"] == 0 for s in steps) and run_step is not None
        message = "; ".join(reply.get("fetch_errors", []))
        return RunCodeResponse(
            status=RunStatus.Success if ok else RunStatus.Failed, message=message,
            compile_result=_result(compile_step), run_result=_result(run_step),
            executor_pod_name=name, files=reply.get("files", {}), queue_time=waited,
        )

    async def _session_run(self, req: RunCodeRequest, job: dict, deadline: float) -> RunCodeResponse:
        if req.language not in ("python", "python3"):
            return RunCodeResponse(status=RunStatus.SandboxError,
                                   message=f"session_id is supported for python only, not {req.language!r}")
        job.update(op="session", code=req.code, timeout=req.run_timeout)
        job["files"].pop(LANGUAGES[req.language].source, None)
        try:
            reply = await self.sessions.call(req.session_id, job, deadline, self._session_worker)
        except SessionError as e:
            return RunCodeResponse(status=RunStatus.SandboxError, message=str(e))
        if "error" in reply:
            return RunCodeResponse(status=RunStatus.Failed, message=reply["error"])
        cell = reply["cells"][0]
        rc = 0 if cell["status"] == "Finished" and not cell["error"] else (None if cell["status"] != "Finished" else 1)
        run = CommandRunResult(status=cell["status"], execution_time=cell["execution_time"], return_code=rc,
                               stdout=cell["stdout"], stderr=cell["stderr"])
        return RunCodeResponse(status=RunStatus.Success if rc == 0 else RunStatus.Failed, run_result=run,
                               message="; ".join(reply.get("fetch_errors", [])), files=reply.get("files", {}))

    async def run_jupyter(self, req: RunJupyterRequest, retried: bool = False, client: str = "") -> RunJupyterResponse:
        self.stats["runs"] += 1
        try:
            job = {"op": "jupyter", "cells": req.cells, "cell_timeout": req.cell_timeout,
                   "total_timeout": req.total_timeout, "memory_mb": self.settings.default_memory_mb,
                   "files": {self._path(p, "files"): (b or "") for p, b in req.files.items()},
                   "fetch_files": [self._path(p, "fetch_files") for p in req.fetch_files],
                   "max_output": self.settings.max_output_bytes, "max_file": self.settings.max_file_bytes}
        except ValueError as e:
            return RunJupyterResponse(status=RunStatus.Failed, message=str(e))
        reply, error, name, waited = await self._call(job, req.total_timeout + GRACE_S, retried, client)
        if reply is None:
            return RunJupyterResponse(status=RunStatus.SandboxError, message=error, executor_pod_name=name,
                                      queue_time=waited)
        if "error" in reply:
            return RunJupyterResponse(status=RunStatus.Failed, message=reply["error"], executor_pod_name=name,
                                      queue_time=waited)
        cells = reply["cells"]
        failed = next((c for c in cells if c["status"] != "Finished"), None)
        ok = failed is None and not any(c["error"] for c in cells) and len(cells) == len(req.cells)
        driver = CommandRunResult(status=failed["status"] if failed else "Finished",
                                  execution_time=round(sum(c["execution_time"] for c in cells), 4))
        return RunJupyterResponse(
            status=RunStatus.Success if ok else RunStatus.Failed, driver=driver, executor_pod_name=name,
            cells=[{k: c[k] for k in ("stdout", "stderr", "display", "error")} for c in cells],
            files=reply.get("files", {}), message="; ".join(reply.get("fetch_errors", [])), queue_time=waited,
        )
