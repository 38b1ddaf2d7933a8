"""Grading a trajectory's container with the task's own tests, after the episode, where the agent cannot reach.

``grade(runtime, box, task)`` (blocking; call it in a thread):

1. **Did the agent end its container?** A container the agent killed (a root agent killing PID 1's
   keeper, or its memory use) is a 0 charged to the agent (``agent_killed_container``), never an
   infrastructure failure it could use to erase a bad grade. A container that vanished for any other
   reason is infrastructure (``container_dead``).
2. **Nothing of the agent runs at grading time.** ``Runtime.seal`` stops every process of the episode,
   whatever its uid, and verifies none is left: Docker kills the container (its PID namespace dies with
   its init) and grades after a restart; bwrap kills the shell's PID namespace and grades in a new one.
   Chosen over freezing: a frozen process still holds open files and mappings a verifier would share.
3. **What the verifier runs is the image's.** The verifier runs ``/bin/bash`` and whatever test.sh
   calls from the image's system directories; a root agent could replace any of them (a trojan
   ``bash``, a ``sitecustomize.py``). ``Runtime.changes`` lists every path the agent added, changed or
   deleted; one under ``TRUSTED`` is a 0 charged to the agent (``agent_tampered_system``). Non-root
   agents cannot write there at all (the documented default for task authors).
4. **The disk cap is total.** A writable layer over ``storage_mb`` is a 0 charged to the agent
   (``agent_exceeded_disk``), where the runtime could not cap it while the agent ran.
5. **The verifier** runs ``/bin/bash /tests/test.sh`` as ``[verifier] user`` (default root) with a fixed
   environment (``VERIFIER_ENV``: a fixed PATH, a fresh empty HOME, no user site-packages) plus
   ``[verifier] env``, in the image's working directory, for at most ``[verifier] timeout_sec``, with
   ``tests/`` copied in root-owned and read-only and a fresh ``/logs/verifier`` writable by the
   verifier's user only.
6. It reads ``/logs/verifier/reward.txt`` (one number) or ``reward.json`` (``{"reward": x, ...}``: the
   other numeric keys become metrics).

A verifier that does not finish within its timeout ran on what the agent left (a FIFO, a hanging
program): a 0 charged to the agent (``agent_verifier_timeout``); ``tasks check`` shows a task whose own
oracle or nop times out. Infrastructure failures raise ``GradingError`` with a cause, never a 0:
``container_dead``, ``docker_error`` / ``runtime_error`` (the runtime failed), ``verifier_error``
(test.sh wrote no readable reward).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from verl_agent.containers import AGENT_KILLED, ContainerError, Runtime
from verl_agent.data.harbor import HarborTask
from verl_agent.tasks.pool import TaskContainer

__all__ = ["FORFEITS", "TRUSTED", "VERIFIER_ENV", "Grade", "GradingError", "copy_in", "grade", "read_reward",
           "tampered"]

TAMPERED, DISK, TIMEOUT = "agent_tampered_system", "agent_exceeded_disk", "agent_verifier_timeout"
FORFEITS = (AGENT_KILLED, TAMPERED, DISK, TIMEOUT)  # a 0 charged to the agent, counted by cause

# What a verifier may run from the image: the shells, interpreters and libraries, the loader's
# configuration, Python's site hooks. Anything of the agent in here voids its grade.
TRUSTED = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/usr/bin", "/usr/sbin", "/usr/lib",
           "/usr/lib32", "/usr/lib64", "/libexec", "/usr/libexec", "/usr/local/bin", "/usr/local/sbin",
           "/usr/local/lib", "/etc/ld.so.preload", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/ld.so.cache",
           "/etc/alternatives", "/etc/python3")
VERIFIER_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/logs/home",
                "LANG": "C.UTF-8", "PYTHONNOUSERSITE": "1", "PYTHONDONTWRITEBYTECODE": "1"}


class GradingError(ContainerError):
    """Grading could not produce a reward (see the module docstring for the causes)."""


@dataclass
class Grade:
    reward: float
    metrics: dict[str, float] = field(default_factory=dict)
    exit_code: int = 0
    output: str = ""  # the tail of test.sh's output, or why the agent forfeited
    seconds: float = 0.0
    forfeit: str = ""  # one of FORFEITS when the 0 is the agent's own doing


def tampered(paths: list[str]) -> list[str]:
    """The paths under ``TRUSTED`` (``/etc/python3*`` by prefix)."""
    return [p for p in paths if any(p == t or p.startswith(t + "/") for t in TRUSTED) or p.startswith("/etc/python3")]


def read_reward(files: dict[str, bytes]) -> tuple[float, dict[str, float]]:
    """(reward, metrics) from reward.txt or reward.json; GradingError when neither reads."""
    txt = files.get("reward.txt")
    if txt is not None:
        try:
            value = float(txt.decode().strip())
        except (UnicodeDecodeError, ValueError):
            raise GradingError(f"/logs/verifier/reward.txt is not a number: {txt[:80]!r}", "verifier_error") from None
        if not math.isfinite(value):
            raise GradingError(f"/logs/verifier/reward.txt is not finite: {value}", "verifier_error")
        return value, {}
    raw = files.get("reward.json")
    if raw is None:
        raise GradingError("test.sh wrote neither /logs/verifier/reward.txt nor reward.json", "verifier_error")
    try:
        data = json.loads(raw)
        value = float(data["reward"])
    except (ValueError, KeyError, TypeError):
        raise GradingError(f"/logs/verifier/reward.json has no numeric 'reward': {raw[:120]!r}",
                           "verifier_error") from None
    if not math.isfinite(value):
        raise GradingError(f"/logs/verifier/reward.json's reward is not finite: {value}", "verifier_error")
    metrics = {str(k): float(v) for k, v in data.items()
               if k != "reward" and isinstance(v, (int, float)) and not isinstance(v, bool)}
    return value, metrics


def _forfeit(cause: str, why: str, t0: float) -> Grade:
    return Grade(0.0, {cause: 1.0}, output=why, seconds=time.perf_counter() - t0, forfeit=cause)


def grade(runtime: Runtime, box: TaskContainer, task: HarborTask, *, timeout: float | None = None) -> Grade:
    """Run the task's tests on the trajectory's final filesystem; see the module docstring."""
    t0 = time.perf_counter()
    cfg = task.config
    c = box.container
    try:
        box.shell.close()
        state = runtime.state(c)
        if not state.running:
            if state.cause == AGENT_KILLED:
                return _forfeit(AGENT_KILLED, state.detail, t0)
            raise GradingError(state.detail, state.cause)
        runtime.seal(c)
        touched = tampered(runtime.changes(c))
        if touched:
            return _forfeit(TAMPERED, "the agent changed what the verifier runs: " + ", ".join(touched[:20]), t0)
        used = runtime.disk_used(c)
        if used is not None and used > cfg.storage_mb << 20:
            return _forfeit(DISK, f"the writable layer holds {used >> 20} MB; storage_mb is {cfg.storage_mb}", t0)
        limit = timeout or cfg.verifier_timeout_sec
        run = runtime.verify(c, Path(task.tests_dir), ["/bin/bash", "/tests/test.sh"], user=cfg.verifier_user or "0",
                             env={**VERIFIER_ENV, **cfg.verifier_env}, timeout=limit)
    except GradingError:
        raise
    except ContainerError as e:
        raise GradingError(str(e), e.cause) from e
    except Exception as e:
        raise GradingError(f"{runtime.name} failed while grading: {type(e).__name__}: {e}",
                           f"{runtime.name}_error") from e
    if run.exit_code is None:  # what it ran on is the agent's: a FIFO, a hanging program, a huge tree
        return _forfeit(TIMEOUT, f"tests/test.sh did not finish within {limit:g} s (verifier timeout_sec) on the "
                                 f"agent's final state: {run.output[-500:]}", t0)
    try:
        reward, metrics = read_reward(run.files)
    except GradingError as e:  # what test.sh printed says why it wrote no reward
        raise GradingError(f"{e}; test.sh (exit {run.exit_code}) printed: {run.output[-1500:] or '(nothing)'}",
                           e.cause) from None
    return Grade(reward, metrics, run.exit_code, run.output, time.perf_counter() - t0)


def copy_in(runtime: Runtime, box: TaskContainer, src: Path, dest_name: str) -> None:
    """Copy a host folder to ``/<dest_name>`` of a live trajectory container (the oracle's solution) and
    give it a fresh shell that sees it (bwrap writes the layer while no shell runs)."""
    runtime.copy_in(box.container, src, dest_name)
    if runtime.name != "docker":
        box.shell.reopen()

