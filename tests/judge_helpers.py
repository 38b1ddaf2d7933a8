"""A judge model's HTTP server for the judge tests: FastAPI + uvicorn on loopback, OpenAI Chat Completions wire.

It grades by rule instead of by a model (a judge model is what cannot run here; the HTTP path is real):
the rubric the tests use renders ``Reference: <ground truth>`` and ``Answer: <response>`` lines, and the
server answers ``Score: 10`` when the reference is in the answer, else ``Score: 0``. Markers in the
message choose a misbehaviour:

- ``[garbage]``: an answer with no score; ``[score:N]``: ``Score: N`` as given
- ``[fail:CODE:N]``: HTTP CODE (429 with ``Retry-After: 0.01``, or 5xx) the first N times this message
  comes, then a normal answer
- ``[hang]``: no answer until the client disconnects (its timeout must end it); ``[slow]``: the answer
  after 0.3 s

It records every request (message, model, Authorization header) and the most requests in flight at once.
"""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

# module level: FastAPI resolves the handler's string annotation (Request) in this module's globals
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

RUBRIC = "Task: {prompt}\nReference: {ground_truth}\nAnswer: {response}\nEnd with 'Score: N' (0-10)."


class JudgeServer:
    """`with JudgeServer() as s:` serves on s.url (``http://127.0.0.1:PORT/v1``) from a thread of its own."""

    def __init__(self, models: tuple[str, ...] = ("judge-model",),
                 grader: Callable[[str, int], str | int] | None = None) -> None:  # fmt: skip
        """`grader(message, times seen)`: the answer text, or an HTTP status to fail with (default: `grade`)."""
        self.models, self.grader = models, grader
        self.requests: list[dict[str, Any]] = []
        self.seen: Counter[str] = Counter()
        self.in_flight = self.max_in_flight = 0
        self._server: Any = None

    def __enter__(self) -> JudgeServer:
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
        config = uvicorn.Config(self._app(), log_level="warning", access_log=False, lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the test judge server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)

    def reset(self) -> None:
        self.requests.clear()
        self.seen.clear()
        self.max_in_flight = 0

    def _app(self) -> Any:
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Any:
            body = await request.json()
            message = body["messages"][-1]["content"]
            self.requests.append({"message": message, "model": body.get("model"),
                                  "authorization": request.headers.get("authorization"), "body": body})
            self.seen[message] += 1
            if body.get("model") not in self.models:
                return JSONResponse({"error": {"message": f"model {body.get('model')!r} not found"}}, status_code=404)
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            try:
                return await self._answer(message, request)
            finally:
                self.in_flight -= 1

        return app

    async def _answer(self, message: str, request: Request) -> Any:
        fail = re.search(r"\[fail:(\d+):(\d+)\]", message)
        if fail and self.seen[message] <= int(fail.group(2)):
            code = int(fail.group(1))
            headers = {"Retry-After": "0.01"} if code == 429 else {}
            return JSONResponse({"error": {"message": "try later"}}, status_code=code, headers=headers)
        if "[hang]" in message:  # until the client gives up
            while not await request.is_disconnected():
                await asyncio.sleep(0.02)
            return JSONResponse({"error": {"message": "client went away"}}, status_code=499)
        if "[slow]" in message:
            await asyncio.sleep(0.3)
        answer = (self.grader or (lambda m, _: grade(m)))(message, self.seen[message])
        if isinstance(answer, int):
            return JSONResponse({"error": {"message": "grader says no"}}, status_code=answer)
        return completion(answer)


def grade(message: str) -> str:
    """The judge's answer text for a rendered RUBRIC message (see the module docstring)."""
    if "[garbage]" in message:
        return "I would rather not say."
    given = re.search(r"\[score:([-\d.]+)\]", message)
    if given:
        return f"Thinking it over.\nScore: {given.group(1)}"
    ref = re.search(r"^Reference: (.*)$", message, re.M).group(1)
    answer = re.search(r"^Answer: (.*)$", message, re.M).group(1)
    return f"The reference is {ref}.\nScore: {10 if ref in answer else 0}"


def completion(text: str) -> dict[str, Any]:
    return {"id": "c0", "object": "chat.completion", "created": 0, "model": "judge-model",
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
