"""Sandbox Fusion's HTTP API as pydantic models (field names and defaults match Sandbox Fusion's).

Extensions: every run response has ``queue_time`` (seconds the request waited for a free sandbox,
apart from the run's ``execution_time``; Sandbox Fusion clients ignore the extra field), and
sessions (see ``verl_agent.sandbox``): ``POST /open_session`` issues a ``session_id``; ``/run_code``
calls that carry it run in one live Python interpreter until ``POST /close_session`` or the idle
timeout. An id the server did not issue is refused.
Unknown fields are ignored, as Sandbox Fusion does; a missing or mistyped field is a 422 naming it.
Two optional request headers: ``X-Sandbox-Retry`` (a retry after a 503, admitted to a reserve of
waiting slots) and ``X-Sandbox-Client`` (the caller's id, which keys the crash-loop back-off; without it
the peer's address does). ``SandboxClient`` sends both.
"""

from __future__ import annotations

from enum import Enum

from pydantic import BaseModel, Field

__all__ = [
    "CLIENT_HEADER", "DEFAULT_MEMORY_MB", "DEFAULT_PORT", "DEFAULT_URL", "RETRY_HEADER", "CellRunResult", "CloseSessionRequest", "OpenSessionResponse",
    "CommandRunResult", "CommandRunStatus",
    "RunCodeRequest",
    "RunCodeResponse", "RunJupyterRequest", "RunJupyterResponse", "RunStatus",
]

DEFAULT_PORT = 8080  # where `verl-agent sandbox serve` / `up` listen and clients look unless told otherwise
DEFAULT_URL = f"http://127.0.0.1:{DEFAULT_PORT}"
DEFAULT_MEMORY_MB = 1024  # a run's memory limit (MiB) when the request sets none, and the most it may ask for

RETRY_HEADER = "x-sandbox-retry"
CLIENT_HEADER = "x-sandbox-client"


class RunStatus(str, Enum):
    """Overall status: ``Failed`` = a step failed or timed out; ``SandboxError`` = our side failed."""

    Success = "Success"
    Failed = "Failed"
    SandboxError = "SandboxError"


class CommandRunStatus(str, Enum):
    Finished = "Finished"
    TimeLimitExceeded = "TimeLimitExceeded"
    Error = "Error"


class CommandRunResult(BaseModel):
    status: CommandRunStatus
    execution_time: float | None = None
    return_code: int | None = None
    stdout: str | None = None
    stderr: str | None = None


class RunCodeRequest(BaseModel):
    code: str = Field(..., description="the code to run")
    language: str = Field(..., description="python, bash, cpp, nodejs, ...")
    compile_timeout: float = Field(10, gt=0, le=600)
    run_timeout: float = Field(10, gt=0, le=600)
    memory_limit_MB: int = Field(-1, description="-1: the server's default limit")
    stdin: str | None = None
    files: dict[str, str | None] = Field(default_factory=dict, description="path -> base64 content")
    fetch_files: list[str] = Field(default_factory=list)
    session_id: str | None = Field(None, max_length=128,
                                   description="extension: an id from POST /open_session; keeps one interpreter alive")


class RunCodeResponse(BaseModel):
    status: RunStatus
    message: str = ""
    compile_result: CommandRunResult | None = None
    run_result: CommandRunResult | None = None
    executor_pod_name: str | None = None
    files: dict[str, str] = Field(default_factory=dict)
    queue_time: float = Field(0.0, description="extension: seconds waited for a free sandbox before the run "
                                              "started (the run's own time is run_result.execution_time)")


class RunJupyterRequest(BaseModel):
    cells: list[str]
    cell_timeout: float = Field(0, ge=0, le=600, description="0: only total_timeout applies")
    total_timeout: float = Field(45, gt=0, le=600)
    kernel: str = "python3"
    files: dict[str, str | None] = Field(default_factory=dict)
    fetch_files: list[str] = Field(default_factory=list)


class CellRunResult(BaseModel):
    stdout: str
    stderr: str
    display: list[dict] = Field(default_factory=list)
    error: list[dict] = Field(default_factory=list)


class RunJupyterResponse(BaseModel):
    status: RunStatus
    message: str = ""
    driver: CommandRunResult | None = None
    cells: list[CellRunResult] = Field(default_factory=list)
    executor_pod_name: str | None = None
    files: dict[str, str] = Field(default_factory=dict)
    queue_time: float = Field(0.0, description="extension: seconds waited for a free sandbox")


class OpenSessionResponse(BaseModel):
    session_id: str = Field(..., description="server-issued, unguessable; pass it as run_code's session_id")


class CloseSessionRequest(BaseModel):
    session_id: str = Field(..., max_length=128)
