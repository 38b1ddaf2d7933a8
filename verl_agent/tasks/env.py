"""TaskEnvironment: one trajectory's world (its container, shell, clock, submission and grade).

The container tools (``bash``, ``str_replace_editor``, ``submit``) and ``TaskInteraction`` are
separate objects, but one trajectory must see one container. ``ToolSession`` gives every tool of a
trajectory the same instance id, so the environments live in a process-wide registry keyed by it:
``attach(instance_id, task_dir)`` from each tool's ``create`` (the first one starts the container,
the others wait for it), ``detach`` from each ``release`` (the last one destroys the container).

The episode ends on ``submit``, on the agent's time limit (``[agent] timeout_sec``: later commands
are refused) or when the agent loop stops. Grading runs once per trajectory, on the first
``calc_reward`` of any of its tools; that tool reports the reward and the others 0, so the session's
sum is the reward exactly once.

The pool behind it is the process's ``ContainerPool`` (``get_pool``), or, with ``pool: ray``, the
pool actor of this Ray node (``verl_agent.tasks.ray_pool``).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from verl_agent.containers import AGENT_KILLED, ContainerError
from verl_agent.data.harbor import HarborTask, load_task
from verl_agent.tasks.grading import Grade, grade
from verl_agent.tasks.pool import ContainerPool, TaskContainer
from verl_agent.tasks.shell import ShellError, ShellResult

__all__ = ["POOL_KEYS", "TaskEnvironment", "attach", "close_pool", "detach", "get_env", "get_pool", "using_pool"]

logger = logging.getLogger(__name__)

POOL_KEYS = ("warm", "allow_internet", "max_output_chars", "pool", "max_starting", "runtime")
_pool: Any = None
_pool_options: dict[str, Any] = {}
_envs: dict[str, TaskEnvironment] = {}
_starting: dict[str, asyncio.Future] = {}
_refs: dict[str, int] = {}


def get_pool(**options: Any) -> Any:
    """The process's container pool (made on first use from `options`: warm, allow_internet,
    max_output_chars, max_starting, pool=local|ray, runtime=docker|bwrap|auto)."""
    global _pool, _pool_options
    if _pool is None:
        _pool_options = dict(options)
        if options.get("pool", "local") == "ray":
            from verl_agent.tasks.ray_pool import NodePoolClient

            _pool = NodePoolClient(max_output=int(options.get("max_output_chars", 16000)),
                                   warm=int(options.get("warm", 2)), allow_internet=bool(options.get("allow_internet")),
                                   max_starting=int(options.get("max_starting", 4)),
                                   runtime=str(options.get("runtime", "auto")))
        else:
            _pool = ContainerPool(str(options.get("runtime", "auto")), warm=int(options.get("warm", 2)),
                                  allow_internet=bool(options.get("allow_internet")),
                                  max_output=int(options.get("max_output_chars", 16000)),
                                  max_starting=int(options.get("max_starting", 4)))
            atexit.register(close_pool)
    elif options and any(options.get(k) != _pool_options.get(k) for k in options):
        logger.debug("container pool already made with %s; ignoring %s", _pool_options, options)
    return _pool


@contextlib.contextmanager
def using_pool(pool: Any):  # noqa: ANN201 - a context manager
    """Make `pool` the process's pool inside the block (e.g. `verl-agent tasks run` hands its own)."""
    global _pool
    previous, _pool = _pool, pool
    try:
        yield pool
    finally:
        _pool = previous


def close_pool() -> None:
    """Remove every container of this process's pool (atexit does this too)."""
    global _pool
    pool, _pool = _pool, None
    if pool is not None:
        pool.close_sync()


@dataclass
class TaskEnvironment:
    """One trajectory's container and episode state."""

    task: HarborTask
    box: TaskContainer
    pool: Any
    started: float = field(default_factory=time.monotonic)
    submitted: bool = False
    graded: Grade | None = None
    reward_claimed: bool = False
    ended: str = ""  # why the container ended under the agent (its own doing): no further commands run
    _grading: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def deadline_left(self) -> float:
        return self.task.config.agent_timeout_sec - (time.monotonic() - self.started)

    def refusal(self) -> str | None:
        """Why no more commands run in this episode, or None."""
        if self.ended:
            return f"Error: the container stopped ({self.ended}); no further commands run."
        if self.submitted:
            return "Error: the task was already submitted; no further commands run."
        if self.deadline_left <= 0:
            return (f"Error: the agent's time limit for this task ({self.task.config.agent_timeout_sec:g} s) is "
                    "over; no further commands run.")
        return None

    async def run(self, command: str, timeout: float, limit: int | None = None) -> ShellResult:
        """Run a command in the trajectory's shell within the episode's remaining time; infra errors raise.
        A container the agent ended is the end of its episode (graded 0), not an error."""
        try:
            return await self.box.shell.run(command, max(0.1, min(timeout, self.deadline_left)), limit)
        except ShellError as e:
            if e.cause != AGENT_KILLED:
                raise ContainerError(str(e), e.cause) from e
            self.ended = str(e)
            return ShellResult(f"[the container stopped: {e}; the episode ends]", 137)

    async def grade(self) -> Grade:
        """Grade once (later calls return the same Grade); GradingError for an infrastructure failure."""
        async with self._grading:
            if self.graded is None:
                self.graded = await asyncio.to_thread(grade, self.pool.runtime, self.box, self.task)
            return self.graded


async def attach(instance_id: str, task_dir: str, **pool_options: Any) -> TaskEnvironment:
    """The trajectory's environment, started on the first attach of `instance_id`."""
    _refs[instance_id] = _refs.get(instance_id, 0) + 1
    if instance_id in _envs:
        return _envs[instance_id]
    fut = _starting.get(instance_id)
    if fut is None:
        fut = _starting[instance_id] = asyncio.get_running_loop().create_future()
        try:
            pool = get_pool(**pool_options)
            task = load_task(task_dir, allow_internet=None)
            box = await pool.acquire(task)
            _envs[instance_id] = env = TaskEnvironment(task, box, pool)
            fut.set_result(env)
        except BaseException as e:
            _refs.pop(instance_id, None)
            fut.set_exception(e)
            fut.exception()  # retrieved: the waiters re-raise it
            raise
        finally:
            _starting.pop(instance_id, None)
        return env
    return await asyncio.shield(fut)


def get_env(instance_id: str) -> TaskEnvironment:
    env = _envs.get(instance_id)
    if env is None:
        raise ContainerError(f"no task environment for instance {instance_id!r} (create was not called or failed)",
                             "container_dead")
    return env


async def detach(instance_id: str) -> None:
    """Drop one reference; the last one destroys the container."""
    left = _refs.get(instance_id, 0) - 1
    if left > 0:
        _refs[instance_id] = left
        return
    _refs.pop(instance_id, None)
    env = _envs.pop(instance_id, None)
    if env is not None:
        await env.pool.release(env.box)
