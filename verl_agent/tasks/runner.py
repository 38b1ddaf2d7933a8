"""Run one task end to end with a fixed agent: ``oracle`` (solution/solve.sh), ``nop`` (nothing) or
``model`` (the agent loop on a local model, or an OpenAI-compatible URL; see ``model_agent.py``).

``run_task`` returns a ``TaskRun``: the reward (None for an infrastructure failure, with its cause),
the reward.json metrics, and timings (image, container start, agent, grading, total). It is what
``verl-agent tasks run`` prints and what ``verl-agent tasks check`` runs for every task of a folder.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from verl_agent.data.harbor import TaskError, load_task
from verl_agent.tasks.grading import copy_in, grade
from verl_agent.tasks.image import ImageError
from verl_agent.tasks.pool import ContainerError, ContainerPool

__all__ = ["AGENTS", "TaskRun", "run_task", "check_tasks"]

AGENTS = ("oracle", "nop", "model")


@dataclass
class TaskRun:
    task: str
    agent: str
    reward: float | None = None
    outcome: str = "ok"  # ok | infra_failure | error (the task itself is broken: TaskError / ImageError)
    cause: str | None = None
    error: str | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    image: str = ""
    image_built: bool = False
    agent_output: str = ""
    verifier_output: str = ""

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["agent_output"], out["verifier_output"] = self.agent_output[-2000:], self.verifier_output[-2000:]
        return out


async def _oracle(pool: ContainerPool, box: Any, task: Any) -> str:
    solve = task.solution_dir / "solve.sh"
    if not solve.is_file():
        raise TaskError(f"{solve}: missing (the oracle agent runs it)")
    await asyncio.to_thread(copy_in, pool.runtime, box, task.solution_dir, "solution")
    res = await box.shell.run("bash /solution/solve.sh", task.config.agent_timeout_sec)
    return f"{res.output}[exit code {res.exit_code}{', timed out' if res.timed_out else ''}]"


async def run_task(task_dir: str | Path, agent: str = "oracle", *, pool: ContainerPool | None = None,
                   model: str | None = None, allow_internet: bool = False, runtime: str = "auto",
                   **model_kwargs: Any) -> TaskRun:
    """One task, one agent, one container; never raises for a task or infrastructure failure."""
    if agent not in AGENTS:
        raise ValueError(f"agent must be one of {AGENTS}, got {agent!r}")
    t0 = time.perf_counter()
    run = TaskRun(task=str(task_dir), agent=agent)
    own = pool is None
    box = None
    try:
        task = load_task(task_dir, allow_internet=allow_internet)
        run.task = task.name
        pool = pool or await asyncio.to_thread(ContainerPool, runtime, warm=0, allow_internet=allow_internet)
        run.image_built = not await asyncio.to_thread(pool.has_image, task)
        t = time.perf_counter()
        run.image = await pool.image_for(task)
        run.timings["image_s"] = time.perf_counter() - t
        if agent == "model":
            from verl_agent.tasks.model_agent import run_model

            return await run_model(task, pool, model, run, **model_kwargs)
        t = time.perf_counter()
        box = await pool.acquire(task)
        run.timings["start_s"] = time.perf_counter() - t
        t = time.perf_counter()
        if agent == "oracle":
            run.agent_output = await _oracle(pool, box, task)
        run.timings["agent_s"] = time.perf_counter() - t
        t = time.perf_counter()
        graded = await asyncio.to_thread(grade, pool.runtime, box, task)
        run.timings["grade_s"] = time.perf_counter() - t
        run.reward, run.metrics, run.verifier_output = graded.reward, graded.metrics, graded.output
    except (TaskError, ImageError) as e:
        run.outcome, run.cause, run.error = "error", type(e).__name__, str(e)
    except ContainerError as e:
        run.outcome, run.cause, run.error = "infra_failure", e.cause, str(e)
    finally:
        if box is not None:
            await pool.release(box)
        if own and pool is not None:
            await pool.close()
        run.timings["total_s"] = time.perf_counter() - t0
    return run


async def check_tasks(folder: str | Path, *, jobs: int = 4, allow_internet: bool = False, runtime: str = "auto"
                      ) -> list[tuple[str, TaskRun, TaskRun]]:  # fmt: skip
    """Oracle and nop on every task of `folder`: [(task dir, oracle run, nop run)], in folder order."""
    from verl_agent.data.harbor import find_tasks

    dirs = find_tasks(folder)
    pool = await asyncio.to_thread(ContainerPool, runtime, warm=0, allow_internet=allow_internet)
    gate = asyncio.Semaphore(max(1, jobs))

    async def one(d: Path, agent: str) -> TaskRun:
        async with gate:
            return await run_task(d, agent, pool=pool, allow_internet=allow_internet)

    try:
        runs = await asyncio.gather(*(one(d, a) for d in dirs for a in ("oracle", "nop")))
    finally:
        await pool.close()
    return [(str(d), runs[2 * i], runs[2 * i + 1]) for i, d in enumerate(dirs)]
