"""Grading a trajectory's container with the task's own tests, after the episode.

``grade(client, box, task)`` (blocking; call it in a thread):

1. stops what the agent left running (every process but the container's init and its keeper), so
   nothing the agent started can touch the verifier's files;
2. moves aside any ``/tests`` and ``/logs`` the agent made, creates ``/logs/verifier`` and copies
   ``tests/`` to ``/tests`` (only now: the agent never had it);
3. runs ``bash /tests/test.sh`` as ``[verifier] user`` (default root) with ``[verifier] env``, in the
   image's working directory, for at most ``[verifier] timeout_sec``;
4. reads ``/logs/verifier/reward.txt`` (one number) or ``reward.json`` (``{"reward": x, ...}``: the
   other numeric keys become metrics).

Infrastructure failures raise ``GradingError`` with a cause, never a 0: ``verifier_timeout``,
``container_dead`` (the container stopped or vanished: OOM, lifetime, removal), ``docker_error``
(the daemon refused or failed), ``verifier_error`` (test.sh wrote no readable reward).
"""

from __future__ import annotations

import io
import json
import math
import secrets
import socket
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verl_agent.tasks.pool import ContainerError, TaskContainer
from verl_agent.data.harbor import HarborTask

__all__ = ["Grade", "GradingError", "copy_dir", "grade", "run_exec"]

_STOP_AGENT = r"""
for d in /proc/[0-9]*; do p=${d#/proc/}
  case " 1 $$ $KEEP " in *" $p "*) continue;; esac
  kill -9 "$p" 2>/dev/null
done; true
"""


class GradingError(ContainerError):
    """Grading could not produce a reward (see the module docstring for the causes)."""


@dataclass
class Grade:
    reward: float
    metrics: dict[str, float] = field(default_factory=dict)
    exit_code: int = 0
    output: str = ""  # the tail of test.sh's output
    seconds: float = 0.0


def _tar_dir(src: Path, arcname: str) -> bytes:
    buf = io.BytesIO()

    def owner(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = "root"
        info.mode |= 0o755 if info.isdir() or info.mode & 0o111 else 0o644
        return info

    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(str(src), arcname=arcname, filter=owner)
    return buf.getvalue()


def copy_dir(client: Any, cid: str, src: Path, dest_name: str) -> None:
    """Copy a host folder to ``/<dest_name>`` of a container (root-owned, world-readable)."""
    if not client.api.put_archive(cid, "/", _tar_dir(src, dest_name)):
        raise GradingError(f"copying {src} into {cid[:12]} failed", "docker_error")


def run_exec(client: Any, cid: str, cmd: list[str], *, user: str = "", env: dict[str, str] | None = None,
             workdir: str | None = None, timeout: float = 60.0) -> tuple[int | None, str]:  # fmt: skip
    """Run one exec to completion within `timeout` s: (exit code or None on timeout, output tail)."""
    ex = client.api.exec_create(cid, cmd, stdout=True, stderr=True, user=user, environment=env, workdir=workdir)
    sock = client.api.exec_start(ex["Id"], socket=True)._sock
    deadline = time.monotonic() + timeout
    data = bytearray()
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None, _demux(data)
            sock.settimeout(left)
            try:
                chunk = sock.recv(1 << 16)
            except socket.timeout:
                return None, _demux(data)
            if not chunk:
                break
            data += chunk
            if len(data) > 4 << 20:
                del data[: len(data) - (2 << 20)]  # keep the tail; framing is lost, so only text survives
    finally:
        sock.close()
    return client.api.exec_inspect(ex["Id"]).get("ExitCode"), _demux(data)


def _demux(data: bytearray) -> str:
    out, i = bytearray(), 0
    while i + 8 <= len(data) and data[i] in (1, 2) and data[i + 1:i + 4] == b"\0\0\0":
        n = int.from_bytes(data[i + 4:i + 8], "big")
        out += data[i + 8:i + 8 + n]
        i += 8 + n
    if i < len(data):
        out += data[i:]
    return out.decode("utf-8", errors="replace")[-4000:]


def _check_running(client: Any, cid: str) -> None:
    import docker.errors

    try:
        state = client.api.inspect_container(cid)["State"]
    except docker.errors.NotFound as e:
        raise GradingError(f"the container {cid[:12]} is gone", "container_dead") from e
    if not state.get("Running"):
        raise GradingError(f"the container {cid[:12]} is not running (status {state.get('Status')}, "
                           f"OOMKilled={state.get('OOMKilled')})", "container_dead")


def _read_file(client: Any, cid: str, path: str) -> bytes | None:
    import docker.errors

    try:
        stream, _ = client.api.get_archive(cid, path)
    except docker.errors.NotFound:
        return None
    with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
        member = tar.next()
        if member is None or not member.isfile():
            return None
        f = tar.extractfile(member)
        return f.read() if f else None


def read_reward(client: Any, cid: str) -> tuple[float, dict[str, float]]:
    """(reward, metrics) from /logs/verifier/reward.txt or reward.json; GradingError when neither reads."""
    txt = _read_file(client, cid, "/logs/verifier/reward.txt")
    if txt is not None:
        try:
            value = float(txt.decode().strip())
        except (UnicodeDecodeError, ValueError):
            raise GradingError(f"/logs/verifier/reward.txt is not a number: {txt[:80]!r}", "verifier_error") from None
        if not math.isfinite(value):
            raise GradingError(f"/logs/verifier/reward.txt is not finite: {value}", "verifier_error")
        return value, {}
    raw = _read_file(client, cid, "/logs/verifier/reward.json")
    if raw is None:
        raise GradingError("test.sh wrote neither /logs/verifier/reward.txt nor reward.json", "verifier_error")
    try:
        data = json.loads(raw)
        value = float(data["reward"])
    except (ValueError, KeyError, TypeError):
        raise GradingError(f"/logs/verifier/reward.json has no numeric 'reward': {raw[:120]!r}",
                           "verifier_error") from None
    metrics = {str(k): float(v) for k, v in data.items()
               if k != "reward" and isinstance(v, (int, float)) and not isinstance(v, bool)}
    return value, metrics


def stop_agent(client: Any, box: TaskContainer) -> None:
    """Kill every process of the container but its init and keeper (the agent's shell included)."""
    box.shell.close()
    run_exec(client, box.id, ["sh", "-c", _STOP_AGENT], user=box.user, env={"KEEP": box.shell.init_children},
             timeout=30)


def grade(client: Any, box: TaskContainer, task: HarborTask, *, timeout: float | None = None) -> Grade:
    """Run the task's tests in the trajectory's container; see the module docstring."""
    import docker.errors

    t0 = time.perf_counter()
    cfg = task.config
    try:
        _check_running(client, box.id)
        stop_agent(client, box)
        aside = secrets.token_hex(4)
        prep = (f"mv /tests /tests.agent-{aside} 2>/dev/null; mv /logs /logs.agent-{aside} 2>/dev/null; "
                "mkdir -p /logs/verifier /logs/agent && chmod 777 /logs /logs/verifier /logs/agent")
        code, out = run_exec(client, box.id, ["sh", "-c", prep], user="0", timeout=30)
        if code != 0:
            raise GradingError(f"preparing /logs/verifier failed (exit {code}): {out[-300:]}", "docker_error")
        copy_dir(client, box.id, task.tests_dir, "tests")
        limit = timeout or cfg.verifier_timeout_sec
        code, out = run_exec(client, box.id, ["bash", "/tests/test.sh"], user=cfg.verifier_user or "0",
                             env=cfg.verifier_env, workdir=box.workdir, timeout=limit)
        if code is None:
            raise GradingError(f"tests/test.sh did not finish within {limit:g} s (verifier timeout_sec)",
                               "verifier_timeout")
        _check_running(client, box.id)
        reward, metrics = read_reward(client, box.id)
    except docker.errors.NotFound as e:
        raise GradingError(f"the container {box.id[:12]} is gone: {e.explanation or e}", "container_dead") from e
    except (docker.errors.APIError, OSError) as e:
        raise GradingError(f"docker failed while grading: {getattr(e, 'explanation', None) or e}",
                           "docker_error") from e
    return Grade(reward, metrics, code, out, time.perf_counter() - t0)
