"""Async client for any Sandbox Fusion compatible server (ours or a real Sandbox Fusion deployment).

Retries (jittered exponential backoff) only what a retry can fix: connection errors and HTTP 5xx, up
to ``max_retries`` times; a 503 overload answer (the server's queue is full) is retried for up to
``overload_retry_s`` seconds, waiting at least its ``Retry-After``, since overload clears as runs
finish. A program's own failure (``Failed``) and a malformed request (422) come back at once.
``retried`` counts the retries by cause (``overloaded``, ``http_5xx``, ``transport``). A retry
carries ``X-Sandbox-Retry``, which lets our server admit it to a reserve of waiting slots that first
attempts cannot take, so a client that got a 503 is not starved by clients that never did; every
request carries ``X-Sandbox-Client`` (``client_id``, random per client), which keys the server's
crash-loop back-off.
``max_concurrency`` caps requests in flight from this client; ``transport`` is injectable
(httpx.MockTransport, ASGITransport) for tests.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
import uuid
from dataclasses import dataclass
from typing import Any

import httpx

from verl_agent.sandbox.api import (
    DEFAULT_URL,
    CLIENT_HEADER, RETRY_HEADER, RunCodeRequest, RunCodeResponse, RunJupyterRequest, RunJupyterResponse,
)

logger = logging.getLogger(__name__)

__all__ = ["ClientLimits", "SandboxClient", "SandboxUnavailable"]


class SandboxUnavailable(RuntimeError):
    """The server could not be reached or stayed overloaded/erroring through every retry."""


@dataclass(frozen=True)
class ClientLimits:
    connect_timeout: float = 5.0
    # added to the run's own timeouts for the HTTP read timeout: at least what a server may add (its default
    # queue_timeout, its grace and one crash back-off), or a queued request is sent again while it runs
    request_slack: float = 45.0
    max_retries: int = 4
    overload_retry_s: float = 60.0  # keep retrying 503 + Retry-After (overload) answers this long
    backoff_base: float = 0.25
    backoff_max: float = 8.0
    max_concurrency: int = 64
    max_connections: int = 64


class SandboxClient:
    def __init__(self, url: str = DEFAULT_URL, limits: ClientLimits | None = None,
                 transport: httpx.AsyncBaseTransport | None = None):
        self.url, self.limits = url.rstrip("/"), limits or ClientLimits()
        lim = self.limits
        self._http = httpx.AsyncClient(
            base_url=self.url, transport=transport,
            limits=httpx.Limits(max_connections=lim.max_connections, max_keepalive_connections=lim.max_connections),
            timeout=httpx.Timeout(None, connect=lim.connect_timeout),
        )
        self._slots = asyncio.Semaphore(lim.max_concurrency)
        self.client_id = uuid.uuid4().hex  # the server keys its crash-loop back-off by it (X-Sandbox-Client)
        self.retried: dict[str, int] = {"overloaded": 0, "http_5xx": 0, "transport": 0}

    async def __aenter__(self) -> SandboxClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def ping(self) -> bool:
        try:
            return (await self._http.get("/v1/ping", timeout=self.limits.connect_timeout)).json() == "pong"
        except (httpx.HTTPError, ValueError):
            return False

    async def run_code(self, code: str | None = None, language: str = "python", *,
                       request: RunCodeRequest | None = None, **fields: Any) -> RunCodeResponse:
        req = request or RunCodeRequest(code=code, language=language, **fields)
        budget = req.compile_timeout + req.run_timeout
        body = req.model_dump(exclude_none=True)
        return RunCodeResponse.model_validate(await self._post("/run_code", body, budget))

    async def run_jupyter(self, cells: list[str], **fields: Any) -> RunJupyterResponse:
        req = RunJupyterRequest(cells=cells, **fields)
        return RunJupyterResponse.model_validate(await self._post("/run_jupyter", req.model_dump(), req.total_timeout))

    async def open_session(self) -> str:
        """A server-issued session id for ``run_code(..., session_id=...)`` (retried while slots are full)."""
        data = await self._post("/open_session", {}, 10.0)
        return str(data["session_id"])

    async def close_session(self, session_id: str) -> bool:
        data = await self._post("/close_session", {"session_id": session_id}, 10.0)
        return bool(data.get("closed"))

    async def _post(self, path: str, body: dict, budget: float) -> dict:
        lim = self.limits
        async with self._slots:
            attempt, tries, overload_until, headers = 0, 0, None, {CLIENT_HEADER: self.client_id}
            while True:
                wait_at_least, tries = 0.0, tries + 1
                try:
                    resp = await self._http.post(path, json=body, headers=headers, timeout=httpx.Timeout(
                        budget + lim.request_slack, connect=lim.connect_timeout))
                except httpx.TransportError as e:
                    reason, cause = f"{type(e).__name__}: {e}", "transport"
                else:
                    if resp.status_code < 500:
                        resp.raise_for_status()  # 4xx: our request is wrong; retrying cannot help
                        return resp.json()
                    reason, cause = f"HTTP {resp.status_code}: {resp.text[:200]}", "http_5xx"
                    retry_after = resp.headers.get("Retry-After", "")
                    if resp.status_code == 503 and retry_after.isdigit():
                        cause, wait_at_least = "overloaded", float(retry_after)
                if cause == "overloaded":  # overload clears as runs finish: retry on a time budget
                    overload_until = overload_until or time.monotonic() + lim.overload_retry_s
                    if time.monotonic() + wait_at_least > overload_until:
                        break
                else:
                    if attempt >= lim.max_retries:
                        break
                    attempt += 1
                delay = min(lim.backoff_max, lim.backoff_base * 2 ** min(attempt, 16)) * random.uniform(0.5, 1.0)
                delay = max(delay, wait_at_least * random.uniform(1.0, 1.5))  # spread the retries of a burst
                self.retried[cause] += 1
                headers[RETRY_HEADER] = "1"  # admitted to the server's reserve queue
                logger.debug("sandbox %s failed (%s); retry in %.2fs", path, reason, delay)
                await asyncio.sleep(delay)
        spent = f" and {lim.overload_retry_s:.0f} s of overload" if overload_until else ""
        raise SandboxUnavailable(f"sandbox at {self.url}{path}: {reason} (after {tries} attempts{spent})")
