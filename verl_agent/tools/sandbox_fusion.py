"""``code_interpreter``: run the model's code in a Sandbox Fusion compatible sandbox (verl's keys).

Config (tool YAML ``config:``), verl names first:
  sandbox_fusion_url   server base URL, or its ``.../run_code`` URL as verl writes it (default: the local server, sandbox.api.DEFAULT_URL)
  default_timeout      run timeout per call, seconds (default 30)
  default_language     language when the call names none (default "python")
  memory_limit_mb      per-run memory limit in MiB (default sandbox.api.DEFAULT_MEMORY_MB)
  num_workers / rate_limit   concurrency cap of calls in flight (the smaller one wins; default 10).
                       With ``enable_global_rate_limit: false`` only num_workers counts. verl shares
                       rate_limit over the cluster through a Ray actor; here it holds per rollout
                       worker (each has its own tool object).
  max_output_chars     stdout/stderr each truncated to this, keeping the head (default 4000)
  enable_session       our extension: one live interpreter per trajectory, from its first python call to
                       release (the session id is issued by the server: POST /open_session). A session the
                       server no longer knows (idle timeout, server restart) is replaced once by a new one and
                       the call retried; the response tells the model that its earlier state was lost.
Returns stdout (and stderr under a header); on timeout or sandbox trouble a clear one-line message.
"""

from __future__ import annotations

import uuid
from typing import Any

from verl_agent.sandbox.api import DEFAULT_MEMORY_MB, DEFAULT_URL
from verl_agent.sandbox.client import ClientLimits, SandboxClient, SandboxUnavailable
from verl_agent.tools.base import BaseTool, ToolResponse
from verl_agent.tools.errors import ToolUnavailable
from verl_agent.tools.schema import OpenAIFunctionToolSchema

__all__ = ["SandboxFusionTool"]

SCHEMA = {
    "type": "function",
    "function": {
        "name": "code_interpreter",
        "description": "Run code in a sandbox and return what it prints. Python by default.",
        "parameters": {
            "type": "object",
            "properties": {
                "code": {"type": "string", "description": "The code to run."},
                "language": {"type": "string", "description": "python (default), bash, cpp, nodejs, ..."},
            },
            "required": ["code"],
        },
    },
}


def _base_url(url: str) -> str:
    url = url.rstrip("/")
    return url[: -len("/run_code")] if url.endswith("/run_code") else url


def _forgotten(resp) -> bool:
    """The server does not know the session (expired, or the server restarted since it was opened)."""
    return resp.status.value == "SandboxError" and (resp.message or "").startswith("unknown session_id")


class SandboxFusionTool(BaseTool):
    def __init__(self, config: dict[str, Any] | None = None, tool_schema: OpenAIFunctionToolSchema | None = None):
        super().__init__(config, tool_schema)
        c = self.config
        self.url = _base_url(str(c.get("sandbox_fusion_url") or DEFAULT_URL))
        self.timeout = float(c.get("default_timeout", 30))
        self.language = str(c.get("default_language", "python"))
        self.memory_mb = int(c.get("memory_limit_mb", DEFAULT_MEMORY_MB))
        self.max_chars = int(c.get("max_output_chars", 4000))
        self.sessions = bool(c.get("enable_session", False))
        keys = ("num_workers", "rate_limit") if c.get("enable_global_rate_limit", True) else ("num_workers",)
        caps = [int(c[k]) for k in keys if c.get(k)]
        cap = min(caps) if caps else 10
        if cap < 1 or self.timeout <= 0:
            raise ValueError(f"{self.name}: num_workers/rate_limit must be >= 1 and default_timeout > 0")
        self.client = SandboxClient(self.url, ClientLimits(max_concurrency=cap, max_connections=cap))
        self._instances: dict[str, str | None] = {}

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return self.tool_schema or OpenAIFunctionToolSchema.model_validate(SCHEMA)

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> str:
        instance_id = instance_id or str(uuid.uuid4())
        self._instances[instance_id] = None  # with sessions: the server issues the id on the first python call
        return instance_id

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
                      ) -> tuple[ToolResponse, float, dict[str, Any]]:
        code = parameters.get("code")
        if not isinstance(code, str) or not code.strip():
            return ToolResponse(text="Error: no code given (parameter 'code' must be a non-empty string)"), 0.0, {}
        language = parameters.get("language") or self.language
        use_session = self.sessions and instance_id in self._instances and language in ("python", "python3")
        lost = False
        try:
            session = await self._session(instance_id) if use_session else None
            resp = await self._run(code, language, session)
            if session is not None and _forgotten(resp):  # idle timeout or a restarted server: once more, fresh
                if self._instances.get(instance_id) == session:
                    self._instances[instance_id] = None
                session, lost = await self._session(instance_id), True
                resp = await self._run(code, language, session)
        except SandboxUnavailable as e:  # the server is down or overloaded: not the model's doing
            raise ToolUnavailable(f"the sandbox is unavailable ({e})", cause="sandbox_unavailable") from e
        run = resp.run_result or resp.compile_result
        # "SandboxError" = the sandbox itself failed (the code's own failures are "Failed"), except for a
        # language it does not run: that one is the model's choice, and the model is told so.
        if resp.status.value == "SandboxError" and not (resp.message or "").startswith("unknown language"):
            raise ToolUnavailable(f"sandbox error: {resp.message or 'no message'}", cause="sandbox_error")
        metrics = {"status": resp.status.value, "run_status": run.status.value if run else None,
                   "execution_time": run.execution_time if run else None}
        text = self._format(resp, run)
        if lost:
            metrics["session_lost"] = True
            text = (f"Note: the interpreter session had expired, so this ran in a fresh one: variables, imports "
                    f"and files from earlier calls are gone.\n{text}")
        return ToolResponse(text=text), 0.0, metrics

    async def _run(self, code: str, language: str, session: str | None):
        return await self.client.run_code(code, language, run_timeout=self.timeout, memory_limit_MB=self.memory_mb,
                                          session_id=session)

    async def _session(self, instance_id: str) -> str | None:
        """The trajectory's session id, opened on first use (parallel first calls share the first one
        opened); None once the trajectory was released."""
        session = self._instances.get(instance_id)
        if session is None:
            session = await self.client.open_session()
            if instance_id not in self._instances or self._instances[instance_id] is not None:
                await self.client.close_session(session)  # released, or a parallel call opened one first
                session = self._instances.get(instance_id)
            else:
                self._instances[instance_id] = session
        return session

    def _format(self, resp, run) -> str:
        if resp.status.value == "SandboxError" or run is None:
            return f"Error: sandbox error: {resp.message or 'no result'}"
        if resp.run_result is None and resp.compile_result is not None:
            head = "Compilation failed" if run.status.value == "Finished" else "Error: compilation timed out"
            return f"{head}:\n{self._cut(run.stderr or run.stdout or '')}".rstrip()
        parts = []
        if run.status.value == "TimeLimitExceeded":
            parts.append(f"Error: timed out after {self.timeout:g} seconds")
        if run.stdout:
            parts.append(self._cut(run.stdout))
        if run.stderr:
            parts.append("stderr:\n" + self._cut(run.stderr, keep_tail=True))  # errors are at the end
        if not parts:
            parts.append(f"(no output; exit code {run.return_code})" if run.return_code else "(no output)")
        return "\n".join(parts)

    def _cut(self, text: str, keep_tail: bool = False) -> str:
        if len(text) <= self.max_chars:
            return text
        note = f"...[truncated {len(text) - self.max_chars} chars]"
        return f"{note}\n{text[-self.max_chars:]}" if keep_tail else f"{text[: self.max_chars]}\n{note}"

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        session = self._instances.pop(instance_id, None)
        if session is not None:
            try:
                await self.client.close_session(session)
            except SandboxUnavailable:
                pass  # the server's idle timeout closes it
