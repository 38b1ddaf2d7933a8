"""LLM-as-judge rewards: a judge model scores each answer over the OpenAI Chat Completions API.

    judge = Judge(api_base="http://127.0.0.1:8000/v1", model="Qwen/Qwen2.5-7B-Instruct")
    reward = await judge.score(prompt="What is 2 + 2?", response="4", ground_truth="4")   # in [0, 1]
    reward = judge.score_sync(...)                                                         # from sync code

Any OpenAI-compatible server works (vLLM, SGLang, our own `rollout/openai/openai_server.py`). Configured in
``reward_model`` (``enable``, ``model.path``, ``judge.*``; see config/reward.py), the judge is the reward function;
a user's ``compute_score`` may also call one itself.

- Rubric: ``scoring_prompt`` is sent as the one user message, with ``{prompt}``, ``{response}``,
  ``{ground_truth}`` and ``{data_source}`` replaced (other braces are left alone, so JSON examples need
  no escaping; an unknown ``{name}`` is an error).
- Score: the last match of ``score_pattern`` (by default a ``Score: x`` line, ``**Score:** x`` or JSON
  ``"score": x``) must be a number inside ``score_range``; it is normalised to [0, 1].
- Requests run on the judge's own event loop (one thread per `Judge`), at most ``max_concurrent`` at once
  whichever threads or loops ask. 429, 5xx, timeouts and connection errors are retried ``max_retries``
  times, waiting ``backoff * 2**attempt`` seconds (at most 8, with jitter; a ``Retry-After`` header
  wins, up to 30).
- Cache: scores by a SHA-256 of the model, the sampling settings, the score format and the rendered
  message (so the rubric, prompt, response and ground truth all count); ``cache_size`` entries, least
  recently used first out; in memory, per process. Failures are not cached. Equal messages asked at
  the same time (a group's identical answers) share one request. ``stats`` counts requests (retries
  included), retries, cache hits and shared answers.
- A judge that cannot be reached or keeps failing raises `JudgeError` with cause ``judge_unavailable``; an
  answer without a valid score raises cause ``judge_unparsable``. The agent loop turns these into
  infrastructure failures counted by that cause, never a reward of 0.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import random
import re
import threading
from collections import OrderedDict
from collections.abc import Awaitable
from typing import Any

__all__ = ["DEFAULT_SCORE_PATTERN", "DEFAULT_SCORING_PROMPT", "PLACEHOLDERS", "Judge", "JudgeError",
           "check_score_pattern", "check_scoring_prompt", "parse_score"]

PLACEHOLDERS = ("prompt", "response", "ground_truth", "data_source")

DEFAULT_SCORING_PROMPT = """You are grading an AI assistant's response to a task.

[Task]
{prompt}

[Reference answer]
{ground_truth}

[Response]
{response}

Judge whether the response answers the task correctly and completely; when a reference answer is given, \
the response must agree with it. Explain briefly, then end with one line of the form "Score: N", where N is \
an integer from 0 (wrong or useless) to 10 (fully correct)."""

# the last "Score: 7", "**Score:** 7/10", "score = 7.5" or JSON "score": 7 in the answer
DEFAULT_SCORE_PATTERN = r"""(?i)\bscore\b["'*\s]*[:=][*\s]*([-+]?\d+(?:\.\d+)?)"""

_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
_MAX_BACKOFF, _MAX_RETRY_AFTER = 8.0, 30.0


class JudgeError(RuntimeError):
    """The judge gave no score; ``cause`` is judge_unavailable or judge_unparsable (an infrastructure failure)."""

    def __init__(self, cause: str, message: str) -> None:
        super().__init__(message)
        self.cause = cause


def check_scoring_prompt(text: str) -> str:
    """The rubric template, or ValueError naming an unknown placeholder or a missing ``{response}``."""
    unknown = sorted({m for m in _PLACEHOLDER.findall(text) if m not in PLACEHOLDERS})
    if unknown:
        raise ValueError(f"scoring_prompt has unknown placeholder(s) {', '.join('{' + u + '}' for u in unknown)}; "
                         f"known: {', '.join('{' + p + '}' for p in PLACEHOLDERS)}")
    if "{response}" not in text:
        raise ValueError("scoring_prompt must contain {response}: the judge cannot grade an answer it is not shown")
    return text


def check_score_pattern(pattern: str) -> re.Pattern[str]:
    """The compiled score regex, or ValueError when it does not compile or has no capturing group."""
    try:
        compiled = re.compile(pattern)
    except re.error as e:
        raise ValueError(f"score_pattern {pattern!r} is not a regular expression: {e}") from None
    if compiled.groups < 1:
        raise ValueError(f"score_pattern {pattern!r} needs a capturing group around the number")
    return compiled


def parse_score(text: str, pattern: re.Pattern[str], score_range: tuple[float, float]) -> float:
    """The last score in `text`, normalised from `score_range` to [0, 1]; JudgeError(judge_unparsable) if none."""
    lo, hi = score_range
    matches = pattern.findall(text or "")
    if not matches:
        raise JudgeError("judge_unparsable", f"the judge's answer has no score matching {pattern.pattern!r}: "
                         f"{(text or '')[-300:]!r}")
    last = matches[-1][0] if isinstance(matches[-1], tuple) else matches[-1]
    try:
        value = float(last)
    except ValueError:
        raise JudgeError("judge_unparsable", f"the judge's score {last!r} is not a number") from None
    if not lo <= value <= hi:
        raise JudgeError("judge_unparsable", f"the judge's score {value:g} is outside score_range [{lo:g}, {hi:g}]")
    return (value - lo) / (hi - lo)


def _retry_after(headers: Any) -> float | None:
    try:
        return min(float(headers.get("retry-after")), _MAX_RETRY_AFTER)
    except (TypeError, ValueError):
        return None


class Judge:
    """A judge model behind an OpenAI-compatible URL; see the module docstring. Also a verl-style
    ``compute_score`` (async): ``await judge(data_source, solution_str, ground_truth, extra_info)``, which reads
    the task from ``extra_info["prompt"]`` (the agent loop puts the sample's prompt there)."""

    def __init__(self, api_base: str, model: str, *, scoring_prompt: str = DEFAULT_SCORING_PROMPT,
                 score_pattern: str = DEFAULT_SCORE_PATTERN, score_range: tuple[float, float] = (0.0, 10.0),
                 api_key: str | None = None, max_concurrent: int = 32, max_retries: int = 3, backoff: float = 0.5,
                 timeout: float = 60.0, max_tokens: int = 512, temperature: float = 0.0,
                 cache_size: int = 100_000) -> None:  # fmt: skip
        if not api_base or not model:
            raise ValueError("a judge needs api_base (its OpenAI-compatible URL) and model (its model name)")
        lo, hi = (float(x) for x in score_range)
        if not lo < hi:
            raise ValueError(f"score_range must be [low, high] with low < high, got {list(score_range)}")
        for name, value, least in [("max_concurrent", max_concurrent, 1), ("max_retries", max_retries, 0),
                                   ("cache_size", cache_size, 0), ("max_tokens", max_tokens, 1)]:
            if int(value) < least:
                raise ValueError(f"{name} must be at least {least}, got {value}")
        if timeout <= 0 or backoff < 0:
            raise ValueError(f"timeout must be > 0 and backoff >= 0, got {timeout} and {backoff}")
        self.url = api_base.rstrip("/") + "/chat/completions"
        self.model, self.template = model, check_scoring_prompt(scoring_prompt)
        self.pattern, self.score_range = check_score_pattern(score_pattern), (lo, hi)
        self.api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        self.max_concurrent, self.max_retries, self.backoff = int(max_concurrent), int(max_retries), float(backoff)
        self.timeout, self.max_tokens, self.temperature = float(timeout), int(max_tokens), float(temperature)
        self.cache_size = int(cache_size)
        self.cache: OrderedDict[bytes, float] = OrderedDict()
        self.stats = {"requests": 0, "retries": 0, "cache_hits": 0, "shared": 0}
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._client: Any = None
        self._slots: asyncio.Semaphore | None = None
        self._inflight: dict[bytes, asyncio.Future] = {}  # one request for equal messages asked at once

    # -- the public calls ----------------------------------------------------------------------

    def render(self, prompt: str, response: str, ground_truth: Any = None, data_source: str = "") -> str:
        """The user message sent to the judge: the rubric with its placeholders filled in."""
        values = {"prompt": prompt, "response": response, "data_source": data_source or "",
                  "ground_truth": "(none)" if ground_truth is None else str(ground_truth)}
        return _PLACEHOLDER.sub(lambda m: values.get(m.group(1), m.group(0)), self.template)

    async def score(self, prompt: str, response: str, ground_truth: Any = None, data_source: str = "") -> float:
        """The judge's score of `response` in [0, 1] (from any event loop); raises JudgeError."""
        return await asyncio.wrap_future(self._submit(self._score(self.render(prompt, response, ground_truth,
                                                                                 data_source))))

    def score_sync(self, prompt: str, response: str, ground_truth: Any = None, data_source: str = "") -> float:
        """`score` for synchronous code (a plain ``compute_score``); do not call it on a running event loop."""
        return self._submit(self._score(self.render(prompt, response, ground_truth, data_source))).result()

    async def __call__(self, data_source: str, solution_str: str, ground_truth: Any = None,
                       extra_info: dict | None = None) -> float:  # fmt: skip
        prompt = str((extra_info or {}).get("prompt", ""))
        return await self.score(prompt, solution_str, ground_truth, data_source)

    def close(self) -> None:
        """Stop the judge's loop and close its connections (a later call starts them again)."""
        with self._lock:
            loop, thread, self._loop = self._loop, self._thread, None
        if loop is not None:
            asyncio.run_coroutine_threadsafe(self._client.aclose(), loop).result()
            loop.call_soon_threadsafe(loop.stop)
            thread.join()
            loop.close()

    def __getstate__(self) -> dict[str, Any]:
        """Settings and cache only: the loop, its thread and connections start again where it is unpickled."""
        state = {**self.__dict__, "_loop": None, "_thread": None, "_client": None, "_slots": None, "_inflight": {}}
        del state["_lock"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state, _lock=threading.Lock())

    # -- the judge's own loop ------------------------------------------------------------------

    def _submit(self, coro: Awaitable[float]) -> Any:
        with self._lock:
            if self._loop is None:
                self._start()
            return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _start(self) -> None:
        import httpx

        if logging.getLogger("httpx").level == logging.NOTSET:  # it logs every request at INFO: one per answer
            logging.getLogger("httpx").setLevel(logging.WARNING)
        loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=loop.run_forever, name="judge-loop", daemon=True)
        self._thread.start()
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        limits = httpx.Limits(max_connections=self.max_concurrent, max_keepalive_connections=self.max_concurrent)

        async def setup() -> None:
            self._client = httpx.AsyncClient(headers=headers, timeout=self.timeout, limits=limits)
            self._slots = asyncio.Semaphore(self.max_concurrent)

        asyncio.run_coroutine_threadsafe(setup(), loop).result()
        self._loop = loop

    def _key(self, message: str) -> bytes:
        what = [self.model, self.temperature, self.max_tokens, self.pattern.pattern, self.score_range, message]
        return hashlib.sha256(json.dumps(what).encode()).digest()

    async def _score(self, message: str) -> float:
        key = self._key(message)
        if key in self.cache:
            self.cache.move_to_end(key)
            self.stats["cache_hits"] += 1
            return self.cache[key]
        task = self._inflight.get(key)
        if task is None:
            task = self._inflight[key] = asyncio.ensure_future(self._fresh(key, message))
            task.add_done_callback(lambda _: self._inflight.pop(key, None))
        else:  # the same message is being asked right now: share its answer
            self.stats["shared"] += 1
        return await asyncio.shield(task)

    async def _fresh(self, key: bytes, message: str) -> float:
        async with self._slots:
            answer = await self._ask(message)
        value = parse_score(answer, self.pattern, self.score_range)
        if self.cache_size:
            self.cache[key] = value
            while len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
        return value

    async def _ask(self, message: str) -> str:
        """The judge's answer text, retrying 429, 5xx, timeouts and connection errors."""
        import httpx

        body = {"model": self.model, "messages": [{"role": "user", "content": message}],
                "temperature": self.temperature, "max_tokens": self.max_tokens}
        attempt = 0
        while True:
            wait = None
            try:
                self.stats["requests"] += 1
                r = await self._client.post(self.url, json=body)
            except httpx.TransportError as e:
                last = f"{type(e).__name__}: {e}"
            else:
                if r.is_success:
                    return _answer_text(r)
                last = f"HTTP {r.status_code}: {r.text[:300]}"
                if r.status_code != 429 and r.status_code < 500:
                    raise JudgeError("judge_unavailable", f"the judge at {self.url} refused the request ({last})")
                wait = _retry_after(r.headers)
            if attempt == self.max_retries:
                raise JudgeError("judge_unavailable", f"the judge at {self.url} failed {attempt + 1} times; "
                                 f"last: {last}")
            self.stats["retries"] += 1
            await asyncio.sleep(wait if wait is not None else
                                min(self.backoff * 2**attempt, _MAX_BACKOFF) * random.uniform(0.5, 1.0))
            attempt += 1


def _answer_text(r: Any) -> str:
    try:
        content = r.json()["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise JudgeError("judge_unavailable", f"the judge's reply is not a chat completion: {r.text[:300]!r}") from None
    if not isinstance(content, str):
        raise JudgeError("judge_unparsable", f"the judge's reply has no text content: {content!r:.300}")
    return content
