"""An OpenAI-compatible Chat Completions endpoint over any `Engine`, recording every session token-exactly.

    server = OpenAIServer(engine, tokenizer, parser, model_names=("policy",))
    await server.start()                           # uvicorn on the running event loop, a free port
    rec = server.open_session(sampling, uid="s0")  # one per trajectory
    base_url, api_key = server.base_url(rec.sid), rec.sid
    ... the agent calls POST {base_url}/chat/completions ...
    server.close_session(rec.sid); await server.stop()

Routes: `POST /sessions/<sid>/v1/chat/completions`, `GET /sessions/<sid>/v1/models`, and the same
under `/v1/...` with the session id as the API key (`Authorization: Bearer <sid>`).
Supported request fields: see `openai_wire.parse_request`; `stream=true` answers with SSE.

Status codes: 400 invalid request (OpenAI error body naming `param`), 401 no or unknown session
key, 404 unknown model or session, 413 body over `max_request_bytes`, 409 session closed,
500 engine failure (recorded as an infrastructure failure of that session). A refused request
never changes the session: the agent may correct it and call again.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import json
import logging
import socket
from typing import Any

# module level: FastAPI resolves the handlers' string annotations (Request) in this module's globals
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from verl_agent.rollout.engine import Engine, SamplingParams
from verl_agent.rollout.openai_wire import (
    ChatRequest, RequestError, completion_body, error_body, parse_request, stream_chunks,
)
from verl_agent.rollout.recorder import BudgetExceeded, Reply, SessionRecorder

logger = logging.getLogger(__name__)

__all__ = ["OpenAIServer"]


class OpenAIServer:
    """The endpoint and its session registry; see the module docstring."""

    def __init__(self, engine: Engine, tokenizer: Any, parser: Any, *, model_names: tuple[str, ...] = ("policy",),
                 host: str = "127.0.0.1", max_request_bytes: int = 4 << 20, use_request_sampling: bool = False,
                 max_prompt_length: int = 512, max_response_length: int = 256) -> None:  # fmt: skip
        self.engine, self.tokenizer, self.parser = engine, tokenizer, parser
        self.model_names, self.host, self.max_request_bytes = tuple(model_names), host, max_request_bytes
        self.use_request_sampling = use_request_sampling
        self.max_prompt_length, self.max_response_length = max_prompt_length, max_response_length
        self.sessions: dict[str, SessionRecorder] = {}
        self.policy_version = 0
        self.port: int | None = None
        self._ids = itertools.count()
        self._server: Any = None
        self._task: asyncio.Task | None = None
        params = inspect.signature(engine.generate).parameters
        self._engine_sessions = "session" in params and callable(getattr(engine, "release_session", None))
        self.app = self._build_app()

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        """Serve on the running event loop (the agents run on it too) on a free port of `host`."""
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, 0))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off", access_log=False,
                                backlog=4096, timeout_keep_alive=30)  # fmt: skip
        self._server = uvicorn.Server(config)
        self._server.install_signal_handlers = lambda: None  # type: ignore[method-assign]  # not ours to take
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what made uvicorn fail
            await asyncio.sleep(0.005)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            await self._task
            self._server = self._task = None

    def base_url(self, sid: str) -> str:
        return f"http://{self.host}:{self.port}/sessions/{sid}/v1"

    # -- sessions ------------------------------------------------------------------------------
    def open_session(self, sampling: SamplingParams, uid: str) -> SessionRecorder:
        sid = f"s{next(self._ids)}"
        rec = SessionRecorder(sid, self.tokenizer, self.parser, sampling, uid=uid,
                              max_prompt_length=self.max_prompt_length, max_response_length=self.max_response_length,
                              policy_version=self.policy_version)  # fmt: skip
        self.sessions[sid] = rec
        return rec

    async def close_session(self, sid: str) -> SessionRecorder:
        """Stop accepting calls for `sid` (later ones get 409) and release its engine session."""
        rec = self.sessions.pop(sid)
        async with rec.lock:  # a call still in flight finishes first
            rec.closed = True
        if self._engine_sessions:
            await self.engine.release_session(sid)
        return rec

    # -- one call ------------------------------------------------------------------------------
    async def complete(self, sid: str, body: Any) -> tuple[ChatRequest, Reply]:
        """Validate, encode, generate and record one call of session `sid`; raises RequestError."""
        rec = self.sessions.get(sid)
        if rec is None:
            raise RequestError(404, f"unknown session {sid!r}", None, "session_not_found")
        req = parse_request(body, self.model_names)
        async with rec.lock:
            if rec.closed:
                raise RequestError(409, f"session {sid!r} is closed (its agent run has ended)", None, "session_closed")
            if rec.infra is not None:
                raise RequestError(500, f"session {sid!r} failed earlier: {rec.infra[1]}", None, rec.infra[0],
                                   "server_error")  # fmt: skip
            try:
                seg, obs, prompt = rec.prepare(req.messages, req.tools)
                overrides = req.sampling if self.use_request_sampling else {}
                sp = rec.sampling_for(seg, req.max_tokens, overrides)
            except BudgetExceeded as e:
                if e.stop_reason == "response_budget":  # the run cannot go on; a too-long first prompt can be fixed
                    rec.stop_reason = rec.stop_reason or e.stop_reason
                rec.counts["context_length_exceeded"] += 1
                raise RequestError(400, str(e), "messages", "context_length_exceeded") from e
            except ValueError as e:  # ChatTemplateError and message errors the template found
                raise RequestError(400, str(e), "messages") from e
            out = await self._generate(rec, prompt, sp)
            new = req.messages[len(seg.history):] if obs else []
            choice = None if req.tool_choice in (None, "auto", "required", "none") else req.tool_choice
            # the version is read after the call: weights change only while no call is in flight (stream.py)
            return req, rec.commit(seg, obs, new, out, bool(req.tools) and req.tool_choice != "none", choice, req.stop,
                                   version=self.policy_version)

    async def _generate(self, rec: SessionRecorder, prompt: list[int], sp: SamplingParams) -> Any:
        try:
            kw = {"session": rec.sid} if self._engine_sessions else {}
            out = await self.engine.generate(prompt, sp, **kw)
            if out.finish_reason == "abort":
                raise RuntimeError("the engine aborted the request")
            return out
        except Exception as e:  # recorded: the agent's later error is then ours, not the policy's
            rec.infra = ("engine_error", f"engine.generate failed: {type(e).__name__}: {e}")
            logger.warning("session %s: %s", rec.sid, rec.infra[1])
            raise RequestError(500, rec.infra[1], None, "engine_error", "server_error") from e

    # -- HTTP ----------------------------------------------------------------------------------
    def _build_app(self) -> Any:
        app = FastAPI(title="verl-agent OpenAI-compatible endpoint", docs_url=None, redoc_url=None)

        def fail(e: RequestError) -> Response:
            return JSONResponse(error_body(e), status_code=e.status)

        async def chat(sid: str, request: Request) -> Response:
            raw = await request.body()
            try:
                if len(raw) > self.max_request_bytes:
                    raise RequestError(413, f"request body of {len(raw)} bytes > {self.max_request_bytes}", None,
                                       "request_too_large")  # fmt: skip
                try:
                    body = json.loads(raw)
                except ValueError as e:
                    raise RequestError(400, f"the body is not valid JSON: {e}") from e
                req, reply = await self.complete(sid, body)
            except RequestError as e:
                if sid in self.sessions:
                    self.sessions[sid].counts["bad_requests" if e.status < 500 else "server_errors"] += 1
                return fail(e)
            cid = f"chatcmpl-{sid}-{next(self._ids)}"
            if req.stream:
                chunks = stream_chunks(reply, req, cid, self.tokenizer)

                async def events():
                    for c in chunks:
                        yield c

                return StreamingResponse(events(), media_type="text/event-stream")
            return Response(json.dumps(completion_body(reply, req, cid, self.tokenizer)), media_type="application/json")

        def key_of(request: Request) -> str:
            auth = request.headers.get("authorization", "")
            return auth[7:].strip() if auth.lower().startswith("bearer ") else ""

        def models() -> dict:
            return {"object": "list", "data": [{"id": m, "object": "model", "created": 0, "owned_by": "verl-agent"}
                                               for m in self.model_names]}  # fmt: skip

        @app.post("/sessions/{sid}/v1/chat/completions")
        async def session_chat(sid: str, request: Request) -> Response:
            return await chat(sid, request)

        @app.post("/v1/chat/completions")
        async def keyed_chat(request: Request) -> Response:
            sid = key_of(request)
            if sid not in self.sessions:
                return fail(RequestError(401, "missing or unknown API key (use the session key)", None,
                                         "invalid_api_key", "authentication_error"))  # fmt: skip
            return await chat(sid, request)

        @app.get("/sessions/{sid}/v1/models")
        async def session_models(sid: str) -> dict:
            return models()

        @app.get("/v1/models")
        async def plain_models() -> dict:
            return models()

        return app
