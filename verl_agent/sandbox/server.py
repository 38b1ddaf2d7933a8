"""FastAPI server speaking Sandbox Fusion's HTTP API (plus ``/open_session``, ``/close_session``, ``/v1/health``).

Status codes: 200 for every run that reached a decision (``Success``/``Failed``/``SandboxError`` in
the body, as Sandbox Fusion does), 422 for a malformed request (FastAPI names the field), 413 for a
body over ``max_body_bytes``, 503 + ``Retry-After`` when overloaded or when ``/open_session`` finds
every session slot taken (clients retry; a retry carrying ``X-Sandbox-Retry`` may use a reserve of
waiting slots, see ``service``).
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from verl_agent.sandbox.api import (
    CLIENT_HEADER, RETRY_HEADER, CloseSessionRequest, OpenSessionResponse, RunCodeRequest, RunCodeResponse,
    RunJupyterRequest, RunJupyterResponse,
)
from verl_agent.sandbox.service import Overloaded, SandboxService
from verl_agent.sandbox.sessions import SessionError

logger = logging.getLogger(__name__)

__all__ = ["BodyLimit", "create_app"]


def _client(request: Request) -> str:
    """Who is calling, for the crash-loop back-off: the client's own id, else its address."""
    return request.headers.get(CLIENT_HEADER) or (request.client.host if request.client else "unknown")


class BodyLimit:
    """ASGI middleware: refuse request bodies over ``max_bytes`` (413) before they are buffered whole.

    The body is read here, whether its length was declared or not (chunked): raising from inside the
    app's own read would not do, as FastAPI answers any error while it reads the body with a 400."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(send)
        chunks, seen = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break  # the client went away: the app sees the disconnect
            chunks.append(message.get("body", b""))
            seen += len(chunks[-1])
            if seen > self.max_bytes:
                return await self._refuse(send)
            if not message.get("more_body"):
                message = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
                break
        pending = [message]

        async def replay():
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send) -> None:
        body = b'{"status":"SandboxError","message":"request body too large (max %d bytes)"}' % self.max_bytes
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def create_app(service: SandboxService, max_body_bytes: int = 64 << 20) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        await service.start()
        try:
            yield
        finally:
            await service.close()

    app = FastAPI(title="verl-agent sandbox (Sandbox Fusion API)", lifespan=lifespan)

    @app.exception_handler(Overloaded)
    async def overloaded(_req: Request, exc: Overloaded) -> JSONResponse:
        return JSONResponse({"status": "SandboxError", "message": f"overloaded: {exc}"}, status_code=503,
                            headers={"Retry-After": "1"})

    @app.get("/v1/ping")
    async def ping() -> str:
        return "pong"

    @app.get("/v1/health")
    async def health() -> dict:
        return {"backend": service.backend.name, "idle_workers": service.pool.idle(), "pool": service.pool.stats(),
                "sessions": len(service.sessions), "recycled": service.pool.recycled,
                "stats": {**service.stats, "crash_backoff_delays": service.backoff.delayed},
                "guarantees": service.backend.guarantees(), "languages": sorted(service.languages)}

    @app.post("/run_code", response_model=RunCodeResponse, response_model_exclude_none=False)
    async def run_code(req: RunCodeRequest, request: Request) -> RunCodeResponse:
        return await service.run_code(req, retried=RETRY_HEADER in request.headers, client=_client(request))

    @app.post("/run_jupyter", response_model=RunJupyterResponse)
    async def run_jupyter(req: RunJupyterRequest, request: Request) -> RunJupyterResponse:
        return await service.run_jupyter(req, retried=RETRY_HEADER in request.headers, client=_client(request))

    @app.post("/open_session", response_model=OpenSessionResponse)
    async def open_session() -> OpenSessionResponse:
        try:
            return OpenSessionResponse(session_id=service.sessions.open())
        except SessionError as e:
            raise Overloaded(str(e)) from e

    @app.post("/close_session")
    async def close_session(req: CloseSessionRequest) -> dict:
        return {"closed": await service.sessions.close(req.session_id)}

    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    return app
