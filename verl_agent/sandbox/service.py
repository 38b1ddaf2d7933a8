"""The sandbox service: turns API requests into agent jobs on pooled workers, and back.

Admission: at most ``max_queue`` requests wait for a worker; beyond that, or after ``queue_timeout``
seconds of waiting, a request fails fast with ``Overloaded`` (HTTP 503 + Retry-After; clients
retry). A worker that crashes or hangs past the server-side deadline is destroyed and replaced, and
its request answers ``SandboxError``: never lost silently, never a 500.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import posixpath
import time
from dataclasses import dataclass

from verl_agent.sandbox.api import (
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
    pool_size: int = 4
    max_queue: int = 64
    queue_timeout: float = 30.0
    max_output_bytes: int = 1 << 20  # per stream; the rest is drained and replaced by a marker
    max_file_bytes: int = 16 << 20
    default_memory_mb: int = 1024
    max_memory_mb: int = 1024
    max_uses: int = 200
    max_sessions: int = 32
    session_idle_timeout: float = 300.0


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
        self.pool = WorkerPool(backend, s.pool_size, max_uses=s.max_uses)
        self.sessions = SessionManager(self.pool, s.max_sessions, s.session_idle_timeout)
        self._waiting = 0
        self.languages = set(backend.languages())
        self.stats = {"runs": 0, "sandbox_errors": 0, "overloaded": 0}

    async def start(self) -> None:
        t0 = time.monotonic()
        await self.pool.start()
        self.sessions.start()
        logger.info("sandbox backend %r: %d warm workers in %.1fs; guarantees: %s", self.backend.name,
                    self.settings.pool_size, time.monotonic() - t0, self.backend.guarantees())

    async def close(self) -> None:
        await self.sessions.close_all()
        await self.pool.close()
        await self.backend.close()

    async def _acquire(self) -> Worker:
        worker = self.pool.try_acquire()
        if worker is not None:
            return worker
        if self._waiting >= self.settings.max_queue:
            self.stats["overloaded"] += 1
            raise Overloaded(f"{self._waiting} requests already waiting for a sandbox; retry later")
        self._waiting += 1
        try:
            return await asyncio.wait_for(self.pool.acquire(), self.settings.queue_timeout)
        except asyncio.TimeoutError as e:
            self.stats["overloaded"] += 1
            raise Overloaded(f"no sandbox free within {self.settings.queue_timeout:.0f}s; retry later") from e
        finally:
            self._waiting -= 1

    async def _call(self, job: dict, deadline: float) -> tuple[dict | None, str, str | None]:
        """Run ``job`` on a pooled worker: (reply, error message, worker name)."""
        worker = await self._acquire()
        try:
            reply = await worker.call(job, deadline)
        except WorkerError as e:
            self.pool.discard(worker)
            self.stats["sandbox_errors"] += 1
            logger.warning("%s; replaced", e)
            return None, f"{e}; the sandbox was replaced", worker.name
        except BaseException:
            self.pool.discard(worker)  # cancelled mid-run: state unknown
            raise
        timed_out = any(s.get("status") != "Finished" for s in reply.get("steps", []) + reply.get("cells", []))
        self.pool.release(worker, bool(reply.get("dirty")) or timed_out)
        return reply, "", worker.name

    def _job(self, req: RunCodeRequest) -> tuple[dict, float]:
        lang = LANGUAGES[req.language]
        files = {_rel_path(p, "files"): (b or "") for p, b in req.files.items()}
        files[lang.source] = base64.b64encode(req.code.encode()).decode()
        mem = req.memory_limit_MB if req.memory_limit_MB > 0 else self.settings.default_memory_mb
        mem = min(mem, self.settings.max_memory_mb) if lang.address_limit else 0
        steps = []
        if lang.compile:
            steps.append({"argv": lang.compile, "timeout": req.compile_timeout, "memory_mb": 0})
        steps.append({"argv": lang.run, "timeout": req.run_timeout, "stdin": req.stdin, "memory_mb": mem})
        job = {"op": "run", "files": files, "steps": steps, "memory_mb": mem,
               "fetch_files": [_rel_path(p, "fetch_files") for p in req.fetch_files],
               "max_output": self.settings.max_output_bytes, "max_file": self.settings.max_file_bytes}
        deadline = req.run_timeout + (req.compile_timeout if lang.compile else 0) + GRACE_S
        return job, deadline

    async def run_code(self, req: RunCodeRequest) -> RunCodeResponse:
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
        reply, error, name = await self._call(job, deadline)
        if reply is None:
            return RunCodeResponse(status=RunStatus.SandboxError, message=error, executor_pod_name=name)
        if "error" in reply:
            return RunCodeResponse(status=RunStatus.Failed, message=reply["error"], executor_pod_name=name)
        steps = reply["steps"]
        compiled = LANGUAGES[req.language].compile is not None
        compile_step, run_step = (steps[0], steps[1] if len(steps) > 1 else None) if compiled else (None, steps[0])
        ok = all(s["status"] == "Finished" and s["return_code"] == 0 for s in steps) and run_step is not None
        message = "; ".join(reply.get("fetch_errors", []))
        return RunCodeResponse(
            status=RunStatus.Success if ok else RunStatus.Failed, message=message,
            compile_result=_result(compile_step), run_result=_result(run_step),
            executor_pod_name=name, files=reply.get("files", {}),
        )

    async def _session_run(self, req: RunCodeRequest, job: dict, deadline: float) -> RunCodeResponse:
        if req.language not in ("python", "python3"):
            return RunCodeResponse(status=RunStatus.SandboxError,
                                   message=f"session_id is supported for python only, not {req.language!r}")
        job.update(op="session", code=req.code, timeout=req.run_timeout)
        job["files"].pop(LANGUAGES[req.language].source, None)
        try:
            reply = await self.sessions.call(req.session_id, job, deadline, self._acquire)
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

    async def run_jupyter(self, req: RunJupyterRequest) -> RunJupyterResponse:
        self.stats["runs"] += 1
        try:
            job = {"op": "jupyter", "cells": req.cells, "cell_timeout": req.cell_timeout,
                   "total_timeout": req.total_timeout, "memory_mb": self.settings.default_memory_mb,
                   "files": {_rel_path(p, "files"): (b or "") for p, b in req.files.items()},
                   "fetch_files": [_rel_path(p, "fetch_files") for p in req.fetch_files],
                   "max_output": self.settings.max_output_bytes, "max_file": self.settings.max_file_bytes}
        except ValueError as e:
            return RunJupyterResponse(status=RunStatus.Failed, message=str(e))
        reply, error, name = await self._call(job, req.total_timeout + GRACE_S)
        if reply is None:
            return RunJupyterResponse(status=RunStatus.SandboxError, message=error, executor_pod_name=name)
        if "error" in reply:
            return RunJupyterResponse(status=RunStatus.Failed, message=reply["error"], executor_pod_name=name)
        cells = reply["cells"]
        failed = next((c for c in cells if c["status"] != "Finished"), None)
        ok = failed is None and not any(c["error"] for c in cells) and len(cells) == len(req.cells)
        driver = CommandRunResult(status=failed["status"] if failed else "Finished",
                                  execution_time=round(sum(c["execution_time"] for c in cells), 4))
        return RunJupyterResponse(
            status=RunStatus.Success if ok else RunStatus.Failed, driver=driver, executor_pod_name=name,
            cells=[{k: c[k] for k in ("stdout", "stderr", "display", "error")} for c in cells],
            files=reply.get("files", {}), message="; ".join(reply.get("fetch_errors", [])),
        )
