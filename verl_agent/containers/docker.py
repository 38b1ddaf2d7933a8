"""The ``docker`` runtime: trajectory containers on a Docker daemon, through the Docker SDK.

Every container (``container_kwargs``):

* no network (``network_disabled`` + ``network_mode=none``: only loopback) unless the spec asks for it;
* ``cap_drop ALL`` but ``ROOT_CAPS`` (held by root processes only: a root agent, the verifier; a
  non-root agent has none), ``no-new-privileges``, private IPC, no Docker
  socket and no host path mounted (no Docker init either: PID 1 comes from the image, below);
* memory (swap included), CPU, pids and file-size limits; ``storage_mb`` also becomes the writable
  layer's size where the storage driver supports it (overlay2 on xfs with pquota), and is checked
  after the episode everywhere else (``disk_used``);
* PID 1 is the image's ``/bin/sh`` running as root (``KEEPER``): it ignores every signal the agent may
  send it (and the kernel ignores SIGKILL/SIGSTOP sent to a PID namespace's init from inside), reaps
  orphans, and exits when its root-owned ``sleep`` ends: a container outlives neither its lifetime nor
  its owner's reaper. Only a root agent can kill that ``sleep``; the keeper then exits with
  ``KEEPER_KILLED`` and ``state`` charges the dead container to the agent;
* the agent's shell is an exec as the agent's user.

Labels: ``verl-agent.tasks=1``, the run id, the owner (``host:pid:process start time``) and the Ray node.
``reap()`` removes every labelled container whose owner process is dead on this host.
"""

from __future__ import annotations

import io
import logging
import os
import tarfile
import time
from pathlib import Path
from typing import Any

from verl_agent.containers.base import (
    AGENT_KILLED,
    CONTAINER_DEAD,
    LABEL,
    OWNER_LABEL,
    ROOT_CAPS,
    RUN_LABEL,
    Channel,
    Container,
    ContainerError,
    ContainerSpec,
    ContainerState,
    Runtime,
    VerifierRun,
    owner_alive,
    upper_changes,
)

__all__ = ["KEEPER", "KEEPER_KILLED", "DockerRuntime", "container_kwargs", "daemon_answers", "reap"]

logger = logging.getLogger(__name__)

KEEPER_KILLED = 71
# PID 1: ignore what the agent can send, reap orphans (``wait`` in dash/bash reaps any child), end with the sleep
KEEPER = ("trap '' HUP INT QUIT TERM USR1 USR2 PIPE ALRM; sleep \"$0\" & s=$!; r=0; "
          f"while [ -d /proc/$s ]; do wait $s; r=$?; done; [ $r = 0 ] || exit {KEEPER_KILLED}")

_KILLER = r"""
S=$1; keep=" $(tr '\n' ' ' < "$2" 2>/dev/null) "; pairs=""
for f in /proc/[0-9]*/stat; do
  read -r line < "$f" 2>/dev/null || continue
  pid=${line%% *}; rest=${line##*) }; set -- $rest; pairs="$pairs $pid:$2"
done
frontier=""
for pp in $pairs; do p=${pp%%:*}; q=${pp##*:}
  if [ "$q" = "$S" ]; then case "$keep" in *" $p "*) ;; *) frontier="$frontier $p";; esac; fi
done
targets=""
while [ -n "$frontier" ]; do
  targets="$targets $frontier"; next=""
  for pp in $pairs; do p=${pp%%:*}; q=${pp##*:}; case " $frontier " in *" $q "*) next="$next $p";; esac; done
  frontier=$next
done
kill -USR1 "$S" 2>/dev/null
[ -n "$targets" ] && kill -9 $targets 2>/dev/null
echo "$targets"
"""


def daemon_answers(timeout: float = 5.0) -> bool:
    """True when a Docker daemon answers (``DOCKER_HOST`` or the default socket)."""
    try:
        import docker
    except ImportError:
        return False
    try:
        client = docker.from_env(timeout=int(max(1, timeout)))
    except Exception:  # noqa: BLE001 - no socket, bad DOCKER_HOST: no daemon
        return False
    try:
        return bool(client.ping())
    except Exception:  # noqa: BLE001
        return False
    finally:
        client.close()


def container_kwargs(spec: ContainerSpec, labels: dict[str, str], storage_opt: bool = False) -> dict[str, Any]:
    """Keyword arguments of ``client.containers.create`` for one trajectory container."""
    from docker.types import Ulimit

    fsize = spec.storage_mb << 20
    kw: dict[str, Any] = dict(
        image=spec.image, entrypoint=["/bin/sh", "-c", KEEPER], command=[str(int(spec.lifetime_s))],
        user="0", detach=True, hostname="task", labels=labels, stdin_open=False, tty=False,
        cap_drop=["ALL"], cap_add=ROOT_CAPS, security_opt=["no-new-privileges"],
        ipc_mode="private", mem_limit=f"{spec.memory_mb}m", memswap_limit=f"{spec.memory_mb}m",
        pids_limit=spec.pids, nano_cpus=int(spec.cpus * 1e9), log_config={"type": "none", "config": {}},
        ulimits=[Ulimit(name="fsize", soft=fsize, hard=fsize), Ulimit(name="core", soft=0, hard=0),
                 Ulimit(name="nofile", soft=4096, hard=4096)],
    )
    if spec.network:
        kw["network_mode"] = "bridge"
    else:
        kw["network_disabled"], kw["network_mode"] = True, "none"
    if storage_opt:
        kw["storage_opt"] = {"size": f"{spec.storage_mb}M"}
    return kw


def reap(client: Any, *, run_id: str | None = None) -> int:
    """Remove task containers of dead owners on this host (or, with ``run_id``, every one of that run).

    Containers of live runs, and of owners on other hosts (a shared remote daemon), are left alone;
    those stop on their own when their lifetime runs out. Returns how many were removed."""
    import docker.errors

    filters = {"label": [f"{LABEL}=1"] + ([f"{RUN_LABEL}={run_id}"] if run_id else [])}
    removed = 0
    try:
        found = client.containers.list(all=True, filters=filters, ignore_removed=True)
    except docker.errors.APIError as e:
        logger.warning("task container reaper: listing failed: %s", e)
        return 0
    for c in found:
        owner = c.labels.get(OWNER_LABEL, "")
        if run_id is None and owner_alive(owner) is not False:
            continue
        try:
            c.remove(force=True)
            removed += 1
        except docker.errors.NotFound:
            removed += 1  # removed meanwhile
        except docker.errors.APIError as e:
            if "already in progress" not in str(e):
                logger.warning("task container reaper: removing %s failed: %s", c.short_id, e)
    if removed:
        logger.info("task container reaper: removed %d container(s)%s", removed,
                    f" of run {run_id}" if run_id else " of dead runs")
    return removed


def tar_dir(src: Path, arcname: str) -> bytes:
    """``src`` as a tar whose members are root-owned, world-readable, writable by nobody but root."""
    buf = io.BytesIO()

    def owner(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = "root"
        info.mode = (info.mode & 0o700) | (0o755 if info.isdir() or info.mode & 0o111 else 0o644)
        return info

    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(str(src), arcname=arcname, filter=owner)
    return buf.getvalue()


def demux(data: bytes | bytearray) -> bytes:
    """The payload of Docker's multiplexed exec stream (stdout and stderr in order); raw bytes pass."""
    out, i = bytearray(), 0
    while i + 8 <= len(data) and data[i] in (1, 2) and data[i + 1:i + 4] == b"\0\0\0":
        n = int.from_bytes(data[i + 4:i + 8], "big")
        out += data[i + 8:i + 8 + n]
        i += 8 + n
    if i < len(data):
        out += data[i:]
    return bytes(out)


class DockerRuntime(Runtime):
    """See the module docstring."""

    name = "docker"

    def __init__(self, client: Any = None) -> None:
        import docker

        self.client = client or docker.from_env(max_pool_size=64, timeout=120)
        info = self.client.info()
        self.ncpu = float(info.get("NCPU") or os.cpu_count() or 1)
        # the daemon caps the writable layer only on overlay2 over xfs (pquota, which the first create finds out)
        self.storage_opt = info.get("Driver") == "overlay2" and any(
            k == "Backing Filesystem" and v == "xfs" for k, v in info.get("DriverStatus") or [])
        self._image_info: dict[str, tuple[str, str]] = {}

    # -- images and starts ------------------------------------------------------------------

    def image_info(self, image: str) -> tuple[str, str]:
        if image not in self._image_info:
            cfg = self.client.images.get(image).attrs.get("Config") or {}
            self._image_info[image] = (cfg.get("User") or "", cfg.get("WorkingDir") or "/")
        return self._image_info[image]

    def start(self, spec: ContainerSpec, labels: dict[str, str]) -> Container:
        import docker.errors

        image_user, workdir = self.image_info(spec.image)
        cid = None
        try:
            c = self._create(spec, labels)
            cid = c.id
            c.start()
        except (docker.errors.APIError, OSError) as e:
            if cid:
                self.destroy(Container(cid, spec, self.name, "", ""))
            raise ContainerError(f"starting a container of {spec.image} failed: "
                                 f"{getattr(e, 'explanation', None) or e}", "docker_error") from e
        return Container(cid, spec, self.name, spec.user or image_user, workdir, labels)

    def _create(self, spec: ContainerSpec, labels: dict[str, str]) -> Any:
        import docker.errors

        try:
            return self.client.containers.create(**container_kwargs(spec, labels, self.storage_opt))
        except docker.errors.APIError as e:
            if not (self.storage_opt and "storage" in str(e).lower()):
                raise
            logger.warning("the daemon refuses a writable-layer size (%s); the disk is checked after the episode",
                           e.explanation or e)
            self.storage_opt = False  # xfs without pquota
            return self.client.containers.create(**container_kwargs(spec, labels, False))

    # -- shells ---------------------------------------------------------------------------------

    def open_shell(self, c: Container, env: dict[str, str]) -> Channel:
        import docker.errors

        try:
            ex = self.client.api.exec_create(c.id, ["bash", "--noprofile", "--norc"], stdin=True, stdout=True,
                                             stderr=True, tty=False, user=c.user, workdir=c.workdir, environment=env)
            sock = self.client.api.exec_start(ex["Id"], socket=True)._sock
        except docker.errors.APIError as e:
            raise ContainerError(f"starting bash in {c.id[:12]} failed: {e.explanation or e}", CONTAINER_DEAD) from e
        return Channel(sock, framed=True)

    def interrupt(self, c: Container, channel: Channel, shell_pid: int, jobs_file: str) -> None:
        self.exec(c, ["sh", "-c", _KILLER, "killer", str(shell_pid), jobs_file], user=c.user, timeout=10)

    def end_shell(self, c: Container, channel: Channel, shell_pid: int) -> None:
        self.exec(c, ["kill", "-9", str(shell_pid)], user=c.user, timeout=10)
        channel.sock.close()

    def exec(self, c: Container, argv: list[str], *, user: str = "0", env: dict[str, str] | None = None,
             workdir: str | None = None, timeout: float = 60.0) -> tuple[int | None, str]:  # fmt: skip
        """Run one exec to completion within `timeout` s: (exit code, or None on timeout; output tail)."""
        ex = self.client.api.exec_create(c.id, argv, stdout=True, stderr=True, user=user, environment=env,
                                         workdir=workdir)
        sock = self.client.api.exec_start(ex["Id"], socket=True)._sock
        deadline = time.monotonic() + timeout
        data = bytearray()
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None, demux(data).decode("utf-8", errors="replace")[-4000:]
                sock.settimeout(left)
                try:
                    chunk = sock.recv(1 << 16)
                except TimeoutError:
                    return None, demux(data).decode("utf-8", errors="replace")[-4000:]
                if not chunk:
                    break
                data += chunk
                if len(data) > 4 << 20:
                    del data[: len(data) - (2 << 20)]  # keep the tail; framing is lost, so only text survives
        finally:
            sock.close()
        return (self.client.api.exec_inspect(ex["Id"]).get("ExitCode"),
                demux(data).decode("utf-8", errors="replace")[-4000:])

    # -- the end of an episode ------------------------------------------------------------------

    def state(self, c: Container) -> ContainerState:
        import docker.errors

        try:
            st = self.client.api.inspect_container(c.id)["State"]
        except docker.errors.NotFound:
            return ContainerState(False, CONTAINER_DEAD, f"the container {c.id[:12]} is gone")
        if st.get("Running"):
            return ContainerState(True)
        detail = (f"the container {c.id[:12]} stopped (exit code {st.get('ExitCode')}, "
                  f"OOMKilled={st.get('OOMKilled')})")
        if st.get("OOMKilled") or st.get("ExitCode") == KEEPER_KILLED:
            return ContainerState(False, AGENT_KILLED, detail)  # its memory, or a root agent killing PID 1's sleep
        return ContainerState(False, CONTAINER_DEAD, detail)

    def seal(self, c: Container) -> None:
        import docker.errors

        try:
            self.client.api.kill(c.id)  # the PID namespace's init dies: the kernel kills every process in it
        except docker.errors.APIError as e:
            if "is not running" not in str(e):
                raise ContainerError(f"stopping {c.id[:12]} failed: {e.explanation or e}", "docker_error") from e
        try:
            self.client.api.wait(c.id, timeout=30)
            st = self.client.api.inspect_container(c.id)["State"]
        except docker.errors.NotFound as e:
            raise ContainerError(f"the container {c.id[:12]} is gone", CONTAINER_DEAD) from e
        except Exception as e:
            raise ContainerError(f"the container {c.id[:12]} did not stop: {e}", "docker_error") from e
        if st.get("Running") or st.get("Pid"):
            raise ContainerError(f"the container {c.id[:12]} still runs after its kill", "docker_error")

    def changes(self, c: Container) -> list[str]:
        """The overlay's upper layer read from this host when the daemon is local and it can be read (a
        walk of a few files), else the daemon's ``diff`` (which compares the layers: hundreds of ms)."""
        upper = self.client.api.inspect_container(c.id).get("GraphDriver", {}).get("Data", {}).get("UpperDir")
        if upper and os.access(upper, os.R_OK | os.X_OK):
            return upper_changes(Path(upper))
        return [d["Path"] for d in self.client.api.diff(c.id) or []]

    def disk_used(self, c: Container) -> int | None:
        found = self.client.api.containers(all=True, size=True, filters={"id": c.id})
        return int(found[0].get("SizeRw") or 0) if found else None

    def verify(self, c: Container, tests_dir: Path, argv: list[str], *, user: str, env: dict[str, str],
               timeout: float) -> VerifierRun:  # fmt: skip
        import docker.errors

        try:
            self.client.api.start(c.id)  # a fresh keeper: nothing of the agent was left to survive the kill
            prep = ("rm -rf /tests /logs && mkdir -p /logs/verifier /logs/home && chmod 755 /logs "
                    f"/logs/verifier && chown {user or '0'} /logs/verifier /logs/home")
            code, out = self.exec(c, ["/bin/sh", "-c", prep], user="0", timeout=30)
            if code != 0:
                raise ContainerError(f"preparing /logs/verifier failed (exit {code}): {out[-300:]}", "docker_error")
            self.copy_in(c, tests_dir, "tests")
            code, out = self.exec(c, argv, user=user or "0", env=env, workdir=c.workdir, timeout=timeout)
            files = {name: data for name in ("reward.txt", "reward.json")
                     if (data := self._read_file(c, f"/logs/verifier/{name}")) is not None}
        except docker.errors.NotFound as e:
            raise ContainerError(f"the container {c.id[:12]} is gone: {e.explanation or e}", CONTAINER_DEAD) from e
        except (docker.errors.APIError, OSError) as e:
            raise ContainerError(f"docker failed while grading: {getattr(e, 'explanation', None) or e}",
                                 "docker_error") from e
        return VerifierRun(code, out, files)

    def _read_file(self, c: Container, path: str) -> bytes | None:
        import docker.errors

        try:
            stream, _ = self.client.api.get_archive(c.id, path)
        except docker.errors.NotFound:
            return None
        with tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
            member = tar.next()
            if member is None or not member.isfile():
                return None
            f = tar.extractfile(member)
            return f.read() if f else None

    def copy_in(self, c: Container, src: Path, dest_name: str) -> None:
        if not self.client.api.put_archive(c.id, "/", tar_dir(src, dest_name)):
            raise ContainerError(f"copying {src} into {c.id[:12]} failed", "docker_error")

    def destroy(self, c: Container) -> None:
        import docker.errors

        try:
            self.client.api.remove_container(c.id, force=True)
        except docker.errors.NotFound:
            pass
        except docker.errors.APIError as e:
            if "already in progress" not in str(e):  # the reaper (same run labels) removes it later
                logger.warning("removing task container %s failed: %s", c.id[:12], e)

    def reap(self, run_id: str | None = None) -> int:
        return reap(self.client, run_id=run_id)

    def close(self) -> None:
        self.client.close()
