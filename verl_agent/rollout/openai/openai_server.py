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
from collections.abc import AsyncIterator, Callable
from typing import Any

# module level: FastAPI resolves the handlers' string annotations (Request) in this module's globals
from fastapi import FastAPI

from verl_agent.engine.contract import Engine, SamplingParams
from verl_agent.rollout.openai.openai_wire import (
    ChatRequest, RequestError, StreamText, chunk_head, completion_body, delta_chunk, error_body, final_chunks,
    forced_prefix, parse_request, role_chunk,
)
from verl_agent.rollout.openai.recorder import BudgetExceeded, Reply, SessionRecorder

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
        self._engine_streams = "on_token" in params  # incremental output (Engine contract, optional)
        self.app = self._build_app()

    # -- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        """Serve on the running event loop (the agents run on it too) on a free port of `host`."""
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, 0))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self._asgi, interface="asgi3", log_level="warning", lifespan="off", access_log=False,
                                proxy_headers=False,
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
    async def complete(self, sid: str, body: Any, on_token: Callable[[int, float], None] | None = None
                       ) -> tuple[ChatRequest, Reply]:  # fmt: skip
        """Validate, encode, generate and record one call of session `sid`; raises RequestError.
        `on_token(id, logprob)` is called for each generated token as it comes, if the engine streams."""
        rec = self.sessions.get(sid)
        if rec is None:
            raise RequestError(404, f"unknown session {sid!r}", None, "session_not_found")
        req = body if isinstance(body, ChatRequest) else parse_request(body, self.model_names)
        async with rec.lock:
            if rec.closed:
                raise RequestError(409, f"session {sid!r} is closed (its agent run has ended)", None, "session_closed")
            if rec.infra is not None:
                raise RequestError(500, f"session {sid!r} failed earlier: {rec.infra[1]}", None, rec.infra[0],
                                   "server_error")  # fmt: skip
            parse_tools = bool(req.tools) and req.tool_choice != "none"
            forced = self._forced_ids(req.tool_choice) if parse_tools else []
            try:
                seg, obs, prompt = rec.prepare(req.messages, req.tools)
                rec.prompt_tail = prompt[-4:]  # a stream reads whether the prompt opened a <think> block
                overrides = req.sampling if self.use_request_sampling else {}
                sp = rec.sampling_for(seg, req.max_tokens, overrides, reserve=len(forced), obs=len(obs))
            except BudgetExceeded as e:
                if e.stop_reason == "response_budget":  # the run cannot go on; a too-long first prompt can be fixed
                    rec.stop_reason = rec.stop_reason or e.stop_reason
                rec.counts["context_length_exceeded"] += 1
                raise RequestError(400, str(e), "messages", "context_length_exceeded") from e
            except ValueError as e:  # ChatTemplateError and message errors the template found
                raise RequestError(400, str(e), "messages") from e
            out = await self._generate(rec, prompt + forced, sp, on_token)
            new = req.messages[len(seg.history):] if obs else []
            choice = None if req.tool_choice in (None, "auto", "required", "none") else req.tool_choice
            # out.versions name each token's policy (stream.py); else the version is read after the call
            return req, rec.commit(seg, obs, new, out, parse_tools, choice, req.stop, version=self.policy_version,
                                   forced=forced, required=parse_tools and req.tool_choice == "required")

    def _forced_ids(self, tool_choice: str | None) -> list[int]:
        """Ids that make the reply a (named) call when tool_choice demands one; [] if the format has none."""
        text = forced_prefix(getattr(self.parser, "name", None), tool_choice)
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    async def _generate(self, rec: SessionRecorder, prompt: list[int], sp: SamplingParams,
                        on_token: Callable[[int, float], None] | None) -> Any:  # fmt: skip
        try:
            kw: dict[str, Any] = {"session": rec.sid} if self._engine_sessions else {}
            if on_token is not None and self._engine_streams:
                kw["on_token"] = on_token
            out = await self.engine.generate(prompt, sp, **kw)
            if out.finish_reason == "abort":
                raise RuntimeError("the engine aborted the request")
            return out
        except Exception as e:  # recorded: the agent's later error is then ours, not the policy's
            rec.infra = ("engine_error", f"engine.generate failed: {type(e).__name__}: {e}")
            logger.warning("session %s: %s", rec.sid, rec.infra[1])
            raise RequestError(500, rec.infra[1], None, "engine_error", "server_error") from e

    # -- HTTP ----------------------------------------------------------------------------------
    # uvicorn serves `_asgi`: chat completions are handled as plain ASGI, the rest goes to the FastAPI app.
    # FastAPI's routing, middleware and dependency layers add per-call work that this hot route does not need.
    async def _asgi(self, scope: dict, receive: Callable, send: Callable) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or scope["method"] != "POST" or not path.endswith(_CHAT):
            return await self.app(scope, receive, send)
        if path == "/v1" + _CHAT:
            sid = _bearer(scope)
            if sid not in self.sessions:
                return await _send_json(send, 401, error_body(RequestError(
                    401, "missing or unknown API key (use the session key)", None, "invalid_api_key",
                    "authentication_error")))  # fmt: skip
        elif path.startswith("/sessions/") and path.count("/") == 5:
            sid = path[len("/sessions/"):-len("/v1" + _CHAT)]
        else:
            return await self.app(scope, receive, send)
        try:
            raw = await _read_body(receive, self.max_request_bytes)
            try:
                body = json.loads(raw)
            except ValueError as e:
                raise RequestError(400, f"the body is not valid JSON: {e}") from e
            req = parse_request(body, self.model_names)
            if sid not in self.sessions:
                raise RequestError(404, f"unknown session {sid!r}", None, "session_not_found")
            if req.stream:
                return await self._stream(sid, req, send)
            req, reply = await self.complete(sid, req)
        except RequestError as e:
            return await self._refuse(sid, e, send)
        cid = f"chatcmpl-{sid}-{next(self._ids)}"
        await _send_json(send, 200, completion_body(reply, req, cid, self.tokenizer))

    async def _refuse(self, sid: str, e: RequestError, send: Callable) -> None:
        if sid in self.sessions:
            self.sessions[sid].counts["bad_requests" if e.status < 500 else "server_errors"] += 1
        await _send_json(send, e.status, error_body(e))

    async def _stream(self, sid: str, req: ChatRequest, send: Callable) -> None:
        """SSE: content deltas while the engine generates (`StreamText` says what may be sent), then the
        tool calls, finish reason, usage and [DONE] from the recorded reply. An error before the first
        token is an ordinary HTTP error, not a stream."""
        queue: asyncio.Queue = asyncio.Queue()
        task = asyncio.ensure_future(self.complete(sid, req, on_token=lambda t, _lp: queue.put_nowait(t)))
        task.add_done_callback(lambda _t: queue.put_nowait(None))
        item = await queue.get()
        if item is None and task.exception() is not None:
            e = task.exception()
            if not isinstance(e, RequestError):
                raise e
            return await self._refuse(sid, e, send)
        await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
        head = chunk_head(req, f"chatcmpl-{sid}-{next(self._ids)}")
        rec = self.sessions.get(sid)
        parser = self.parser if req.tools and req.tool_choice != "none" else None
        tail = self.tokenizer.decode(rec.prompt_tail) if rec is not None else ""
        text = StreamText(self.tokenizer, parser, req.stop, hold_all=bool(self._forced_ids(req.tool_choice))
                          and parser is not None, reasoning_parser=self.parser,
                          opened=tail.rstrip().endswith("<think>"))  # fmt: skip
        body = [role_chunk(head)]
        async for ids in _arrivals(queue, item):
            body += [delta_chunk(head, field, delta) for field, delta in text.push(ids)]
            if body:
                await send({"type": "http.response.body", "body": b"".join(body), "more_body": True})
                body = []
        try:
            _req, reply = task.result()
        except RequestError as e:  # the engine failed mid-stream: OpenAI sends an error event
            if rec is not None:
                rec.counts["server_errors"] += 1
            body.append(b"data: " + json.dumps(error_body(e)).encode() + b"\n\n")
        else:
            rest = text.final(reply.message.content or "", reply.message.reasoning_content)
            body += final_chunks(reply, req, head, rest, self.tokenizer)
        await send({"type": "http.response.body", "body": b"".join(body), "more_body": False})

    def _build_app(self) -> Any:
        app = FastAPI(title="verl-agent OpenAI-compatible endpoint", docs_url=None, redoc_url=None)

        def models() -> dict:
            return {"object": "list", "data": [{"id": m, "object": "model", "created": 0, "owned_by": "verl-agent"}
                                               for m in self.model_names]}  # fmt: skip

        @app.get("/sessions/{sid}/v1/models")
        async def session_models(sid: str) -> dict:
            return models()

        @app.get("/v1/models")
        async def plain_models() -> dict:
            return models()

        return app


_CHAT = "/chat/completions"
_SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


async def _arrivals(queue: asyncio.Queue, item: int | None) -> AsyncIterator[list[int]]:
    """The token ids put on `queue` (starting with `item`) until None, in batches of all that had arrived."""
    done = item is None
    while not done:
        ids = [item]
        while not queue.empty():
            nxt = queue.get_nowait()
            if nxt is None:
                done = True
                break
            ids.append(nxt)
        yield ids
        if not done:
            item = await queue.get()
            done = item is None


def _bearer(scope: dict) -> str:
    for k, v in scope["headers"]:
        if k == b"authorization":
            auth = v.decode("latin-1")
            return auth[7:].strip() if auth.lower().startswith("bearer ") else ""
    return ""


async def _read_body(receive: Callable, limit: int) -> bytes:
    """The request body; a body over `limit` bytes is refused (413) as soon as it is seen to be."""
    parts, n = [], 0
    while True:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise RequestError(400, "the client disconnected before sending the whole body")
        chunk = msg.get("body", b"")
        n += len(chunk)
        if n > limit:
            raise RequestError(413, f"request body of more than {limit} bytes (max_request_bytes)", None,
                               "request_too_large")  # fmt: skip
        parts.append(chunk)
        if not msg.get("more_body"):
            return b"".join(parts)


async def _send_json(send: Callable, status: int, obj: Any) -> None:
    data = json.dumps(obj, ensure_ascii=False).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]})
    await send({"type": "http.response.body", "body": data})
