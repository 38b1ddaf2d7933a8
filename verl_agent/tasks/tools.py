"""The container tools: ``bash``, ``str_replace_editor`` and ``submit``, for tool YAML.

    tools:
      - class_name: verl_agent.tasks.tools.BashTool
        config: {type: native, timeout: 60, max_output_chars: 16000, warm: 2}
      - class_name: verl_agent.tasks.tools.EditorTool
        config: {type: native}
      - class_name: verl_agent.tasks.tools.SubmitTool
        config: {type: native}

A dataset of Harbor tasks (``data.train_files`` naming a task folder or a JSONL of task paths) gives
every tool ``create_kwargs.task_dir``; the tools of one trajectory share one container (see
``env.py``). Config keys: ``timeout`` (bash: the longest a call may run, seconds; the model may ask
for less with its ``timeout`` argument), and the pool's keys on any of the tools, first one wins:
``warm`` (started containers kept per image), ``allow_internet`` (run tasks that ask for internet;
default false: refused), ``max_output_chars`` (bash output cap), ``max_starting`` (parallel starts),
``pool`` (``local``: this process's pool; ``ray``: the pool actor of this Ray node).

The reward is the task's test result, computed by grading on the first ``calc_reward``; a failure of
the container, the daemon or the verifier raises, so the agent loop records an infrastructure
failure with its cause instead of a reward. Results are ordinary tool observations (loss mask 0).
"""

from __future__ import annotations

import asyncio
from typing import Any

from verl_agent.containers import runtime_names
from verl_agent.tasks.editor import EDITOR_SCHEMA, Editor
from verl_agent.tasks.env import POOL_KEYS, attach, close_pool, detach, get_env
from verl_agent.tasks.pool import ContainerError
from verl_agent.tools.base import BaseTool, ToolResponse
from verl_agent.tools.errors import ToolConfigError, ToolUnavailable
from verl_agent.tools.schema import OpenAIFunctionToolSchema

__all__ = ["BashTool", "EditorTool", "SubmitTool", "format_result"]

BASH_SCHEMA = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": ("Run a bash command in the task's container. The shell persists between calls "
                        "(cwd, variables, background jobs). Output is cut when long; the exit code is shown."),
        "parameters": {
            "type": "object",
            "properties": {
                "command": {"type": "string", "description": "The command to run."},
                "timeout": {"type": "number", "description": "Seconds before the command is killed (optional)."},
            },
            "required": ["command"],
        },
    },
}
SUBMIT_SCHEMA = {
    "type": "function",
    "function": {"name": "submit", "description": "Submit: the task is finished and gets checked now. Call it "
                 "once, when done.", "parameters": {"type": "object", "properties": {}}},
}


def format_result(res: Any) -> str:
    """A ShellResult as the model sees it: the output, then one status line."""
    text = res.output if res.output else "(no output)\n"
    if not text.endswith("\n"):
        text += "\n"
    if res.timed_out:
        status = f"[command timed out after {res.timeout:.3g} s and was killed; exit code {res.exit_code}]"
        if res.restarted:
            status += "\n[the shell was replaced: cwd, variables and background jobs were reset]"
    else:
        status = f"[exit code {res.exit_code}]"
    return text + status


def _ended(env: Any) -> tuple[ToolResponse, float, dict[str, Any]] | None:
    """A container tool's answer once the episode is over (submitted, or past the agent's time limit), else None."""
    refused = env.refusal()
    return (ToolResponse(text=refused), 0.0, {"episode_done": True}) if refused else None


class _ContainerTool(BaseTool):
    """Shared lifecycle: attach to the trajectory's container on create, grade on calc_reward."""

    default_schema: dict[str, Any] = {}
    own_keys: tuple[str, ...] = ()

    def __init__(self, config: dict[str, Any] | None = None, tool_schema: OpenAIFunctionToolSchema | None = None):
        super().__init__(config, tool_schema)
        unknown = set(self.config) - {"type", *POOL_KEYS, *self.own_keys}
        if unknown:
            raise ToolConfigError(f"{type(self).__name__}: unknown config key(s) {sorted(unknown)}; "
                                  f"allowed: {sorted({*POOL_KEYS, *self.own_keys})}")
        self.pool_options = {k: self.config[k] for k in POOL_KEYS if k in self.config}
        runtime = self.pool_options.get("runtime", "auto")
        if runtime not in runtime_names():
            raise ToolConfigError(f"{type(self).__name__}: runtime must be one of {', '.join(runtime_names())}; got "
                                  f"{runtime!r}")

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        return self.tool_schema or OpenAIFunctionToolSchema.model_validate(self.default_schema)

    async def create(self, instance_id: str | None = None, task_dir: str | None = None, **kwargs: Any) -> str:
        if not task_dir:
            raise ToolConfigError(f"{self.name}: no task: the dataset row must give create_kwargs.task_dir "
                                  "(load Harbor tasks with data.train_files naming a task folder)")
        iid = await super().create(instance_id)
        try:
            await attach(iid, task_dir, **self.pool_options)
        except ContainerError as e:
            raise ToolUnavailable(str(e), cause=e.cause) from e
        return iid

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        env = get_env(instance_id)
        graded = await env.grade()  # GradingError (with its cause) propagates: never a 0
        if env.reward_claimed:
            return 0.0
        env.reward_claimed = True
        return graded.reward

    def reward_metrics(self, instance_id: str) -> dict[str, float]:
        """reward.json's other numbers (``verifier/<name>``) and the grading time, for the trajectory."""
        graded = get_env(instance_id).graded
        if graded is None:
            return {}
        return {"verifier/seconds": graded.seconds, **{f"verifier/{k}": v for k, v in graded.metrics.items()}}

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        await detach(instance_id)

    async def shutdown(self) -> None:
        """Remove the process's warm containers: a Ray worker is killed without running atexit."""
        await asyncio.to_thread(close_pool)


class BashTool(_ContainerTool):
    default_schema = BASH_SCHEMA
    own_keys = ("timeout",)

    def __init__(self, config: dict[str, Any] | None = None, tool_schema: OpenAIFunctionToolSchema | None = None):
        super().__init__(config, tool_schema)
        self.timeout = float(self.config.get("timeout", 60))
        if self.timeout <= 0:
            raise ToolConfigError(f"{self.name}: timeout must be > 0, got {self.timeout}")

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
                      ) -> tuple[ToolResponse, float, dict[str, Any]]:
        env = get_env(instance_id)
        if (done := _ended(env)) is not None:
            return done
        asked = parameters.get("timeout")
        timeout = min(self.timeout, float(asked)) if isinstance(asked, (int, float)) and asked > 0 else self.timeout
        try:
            res = await env.run(str(parameters.get("command", "")), timeout)
        except ContainerError as e:
            raise ToolUnavailable(str(e), cause=e.cause) from e
        metrics = {"exit_code": res.exit_code, "timed_out": res.timed_out, "cut_chars": res.cut_chars}
        return ToolResponse(text=format_result(res)), 0.0, metrics


class EditorTool(_ContainerTool):
    default_schema = EDITOR_SCHEMA
    own_keys = ("timeout",)

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
                      ) -> tuple[ToolResponse, float, dict[str, Any]]:
        env = get_env(instance_id)
        if (done := _ended(env)) is not None:
            return done
        timeout = float(self.config.get("timeout", 60))

        async def run(cmd: str) -> Any:
            return await env.run(cmd, timeout, limit=8 << 20)

        try:
            text = await Editor(run)(parameters)
        except Exception as e:  # the shell or container died under the edit
            from verl_agent.tasks.shell import ShellError

            if isinstance(e, (ShellError, ContainerError)):
                raise ToolUnavailable(str(e), cause=getattr(e, "cause", "container_dead")) from e
            raise
        return ToolResponse(text=text), 0.0, {}


class SubmitTool(_ContainerTool):
    """Ends the episode: later commands are refused, and the agent loop stops after this turn."""

    default_schema = SUBMIT_SCHEMA

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
                      ) -> tuple[ToolResponse, float, dict[str, Any]]:
        env = get_env(instance_id)
        env.submitted = True
        return ToolResponse(text="Submitted; the task is checked now."), 0.0, {"episode_done": True}
