"""``docker`` backend: one long-lived runner container per warm worker, the agent as its PID 1.

Containers are managed (created, started, updated, removed, listed, probed) with the ``docker`` SDK, as
the container tasks' pool manages its own (``verl_agent/tasks``); its blocking calls run in threads off
the event loop. The agent speaks over the container's attached stdin/stdout (``AttachedContainer``), so
a run costs no ``docker exec``, nothing is created on the request path, and no ``docker`` CLI process
stays beside each sandbox (each would hold host memory and add to every start). That attach stream is
the one piece spoken by hand: every run's reply travels on it, and the SDK reads it only with blocking
calls (a thread per sandbox, each reply crossing into the event loop), so the HTTP upgrade and Docker's
stream framing are read here, in the event loop. Every container: no network (its own network
namespace with only loopback), a non-root
uid, ``CapDrop ALL``, ``no-new-privileges``, read-only root, size-limited tmpfs /tmp and /var/tmp owned by
the run uid, memory/pids/CPU limits, private IPC, no log driver (output never lands on the host disk),
and only Docker's own PATH/HOSTNAME/HOME in its env.

Why the Engine API's ``NetworkDisabled`` and not ``docker run --network none``: the latter gives every
container a prestart hook that re-executes the whole dockerd binary (``libnetwork-setkey``), a large
share of the CPU a container start costs. ``NetworkDisabled`` (the SDK's ``network_disabled``) keeps the
empty network namespace and drops the hook, so a burst of starts finishes sooner. A container also
starts at a high CPU weight (``STARTING_CPU_SHARES``) and drops to Docker's default once its agent is
ready: in a burst, the starts would otherwise share the cores equally with every sandbox already
running a user's code.

Guarantees are measured, not assumed: at start-up one probe container is created with exactly the
runner's configuration and reports its uid, interfaces, root mount, capability sets, PID, environment
and cgroup limits; ``guarantees()`` returns what it measured, and any failed guarantee refuses the
backend (``IsolationError`` naming it), so a server never serves on a weakened sandbox.

Containers carry two labels: ``verl-agent.sandbox=1`` and ``verl-agent.sandbox.server=<instance
id>``. A backend only ever removes containers with its own instance id: pass the same
``instance_id`` to a restarted server to remove what its crashed predecessor left behind; another
server's containers on the same host are never touched.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import docker
import docker.errors
from docker.models.containers import Container
from docker.types import Ulimit

from verl_agent.sandbox.api import DEFAULT_MEMORY_MB
from verl_agent.sandbox.backends.base import READ_LIMIT, SandboxBackend, Worker, agent_argv, shared_tmp
from verl_agent.sandbox.backends.probe import (GUARANTEES, PROBE, SCRATCH, IsolationError, check_weaken, judge,
                                               parse_probe, unclaimed)
from verl_agent.sandbox.languages import LANGUAGES

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_IMAGE", "AttachedContainer", "DockerBackend", "IsolationError", "docker_available",
           "remove_containers"]

DEFAULT_IMAGE = "verl-agent-sandbox-runner:latest"
SERVER_LABEL = "verl-agent.sandbox.server"
STARTING_CPU_SHARES, CPU_SHARES = 65536, 1024  # while the agent starts / from then on (Docker's default)
# What the SDK raises: its own errors, and (requests' and the socket's) OSError, which APIError is too.
DOCKER_ERRORS = (docker.errors.DockerException, OSError)


def docker_socket() -> str:
    """The daemon's unix socket: ``DOCKER_HOST`` when it names one, else Docker's default path."""
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    if not host.startswith("unix://"):
        raise RuntimeError(f"docker backend: DOCKER_HOST={host!r} is not a unix socket (the only kind supported)")
    return host[len("unix://"):]


def docker_client(timeout: float = 60.0) -> docker.DockerClient:
    """An SDK client of the daemon at ``docker_socket()``."""
    return docker.DockerClient(base_url=f"unix://{docker_socket()}", timeout=int(timeout), max_pool_size=16)


def docker_available(timeout: float = 10.0) -> bool:
    """True when the daemon answers."""
    try:
        client = docker_client(timeout)
    except (*DOCKER_ERRORS, RuntimeError):
        return False
    try:
        return bool(client.ping())
    except DOCKER_ERRORS:
        return False
    finally:
        client.close()


def remove_containers(instance_id: str, client: docker.DockerClient | None = None) -> int:
    """Remove the runner containers labelled with ``instance_id`` (and no other); returns how many."""
    own = client or docker_client()
    try:
        found = own.containers.list(all=True, sparse=True, filters={"label": f"{SERVER_LABEL}={instance_id}"})
        for container in found:
            try:
                container.remove(force=True)
            except docker.errors.NotFound:
                pass  # gone meanwhile
            except DOCKER_ERRORS as e:
                logger.warning("docker backend: removing %s failed: %s", container.id[:12], e)
    finally:
        if client is None:
            own.close()
    if found:
        logger.info("removed %d sandbox containers of instance %s", len(found), instance_id)
    return len(found)


class DockerBackend(SandboxBackend):
    name = "docker"

    def __init__(self, image: str = DEFAULT_IMAGE, uid: int = 10001, memory_mb: int = DEFAULT_MEMORY_MB, pids: int = 128,
                 cpus: float = 1.0, tmpfs_mb: int = 64, instance_id: str | None = None,
                 weaken: frozenset[str] = frozenset()):
        self.weaken = check_weaken("docker", weaken)  # test-only (probe.WEAKENINGS); never claimed
        if not docker_available():
            raise RuntimeError("docker backend: the docker daemon does not answer (run scripts/setup_docker.sh)")
        self._docker = docker_client()
        # the SDK blocks: its calls run here, as many at once as the client has connections (removals of a
        # burst's sandboxes need not queue behind the event loop's few default threads)
        self._calls = ThreadPoolExecutor(16, thread_name_prefix="docker-api")
        try:
            self._docker.images.get(image)
        except docker.errors.ImageNotFound:
            self._docker.close()
            raise RuntimeError(f"docker backend: image {image!r} is missing (run `verl-agent sandbox build-image`)")
        self.image, self.uid, self.memory_mb, self.pids, self.cpus, self.tmpfs_mb = (
            image, uid, memory_mb, pids, cpus, tmpfs_mb)
        self.instance_id = instance_id or uuid.uuid4().hex
        if not self.instance_id.replace("-", "").isalnum():
            raise ValueError(f"docker backend: instance_id must be letters, digits and '-', got {instance_id!r}")
        self._shared_tmp = shared_tmp(self.weaken)  # weakened private_tmp only
        self.remove_stale()  # only ours: a predecessor with the same instance id
        try:
            self._guarantees = self.probe()
        except IsolationError:
            if self._shared_tmp:
                shutil.rmtree(self._shared_tmp, ignore_errors=True)
            raise

    def guarantees(self) -> dict[str, bool]:
        return {k: ok for k, (ok, _) in self._guarantees.items()}

    def probe(self) -> dict[str, tuple[bool, str]]:
        """Start one container with the runner's flags and measure every guarantee; refuse on a failure."""
        want = {"memory": self.memory_mb << 20, "pids": self.pids, "tmp": self.tmpfs_mb << 20, "scratch": SCRATCH}
        name = self.new_name("verl-sbx-probe")
        out, err = b"", b""
        try:
            container = self._docker.containers.create(
                name=name, **self._config(["/usr/bin/python3", "-I", "-c", PROBE, json.dumps(want)]))
            stream = container.attach(stdout=True, stderr=True, stream=True, demux=True)  # before the start
            container.start()
            for o, e in stream:  # until the container ends (a read idle for the client's timeout raises)
                out, err = out + (o or b""), err + (e or b"")
            found = parse_probe(out.decode(errors="replace"))
        except (*DOCKER_ERRORS, ValueError, IndexError, TypeError) as e:
            why = err.decode(errors="replace").strip()[-300:] or f"{type(e).__name__}: {e}"
            raise IsolationError(f"docker backend: the isolation probe did not run ({why}); refusing to serve") from e
        finally:
            with contextlib.suppress(*DOCKER_ERRORS):
                self._docker.api.remove_container(name, force=True)
        judge("docker", found, set(GUARANTEES) - unclaimed(self.weaken))  # docker claims every one not weakened
        logger.info("docker backend %s: every guarantee probed and holds: %s", self.instance_id, sorted(found))
        return found

    def languages(self) -> list[str]:
        return list(LANGUAGES)  # the runner image carries python3, bash, gcc/g++ and nodejs

    def _config(self, cmd: list[str]) -> dict[str, Any]:
        """``containers.create``'s keyword arguments: the runner's isolation, in one place (probe and workers)."""
        uid = f"{self.uid}"
        tmpfs = f"rw,exec,nosuid,nodev,size={self.tmpfs_mb}m,uid={uid},gid={uid},mode=0700"
        config = dict(
            image=self.image, command=cmd, user=f"{uid}:{uid}", working_dir="/tmp", hostname="sandbox",
            labels={"verl-agent.sandbox": "1", SERVER_LABEL: self.instance_id},
            detach=False, stdin_open=True,  # stdin, stdout and stderr attached; stdin closes with the attach
            use_config_proxy=False,  # no proxy variables from ~/.docker/config.json in the sandbox's env
            network_disabled=True,  # a network namespace of its own, and no libnetwork hook at start
            network_mode="none", log_config={"type": "none", "config": {}},
            cap_drop=["ALL"], security_opt=["no-new-privileges"], read_only=True,
            ipc_mode="private", tmpfs={"/tmp": tmpfs, "/var/tmp": tmpfs}, shm_size=self.tmpfs_mb << 20,
            mem_limit=self.memory_mb << 20, memswap_limit=self.memory_mb << 20, pids_limit=self.pids,
            nano_cpus=int(self.cpus * 1e9), cpu_shares=STARTING_CPU_SHARES,
            ulimits=[Ulimit(name="nofile", soft=1024, hard=1024), Ulimit(name="core", soft=0, hard=0)],
        )
        return self._weakened(config) if self.weaken else config

    def _weakened(self, config: dict[str, Any]) -> dict[str, Any]:
        """Test-only: ``config`` without the guarantees in ``weaken`` (limits raised to a bounded multiple)."""
        host_env = [f"{k}={v}" for k, v in os.environ.items()]
        changes = {
            "non_root_uid": lambda: config.update(user="0:0"),
            "no_network": lambda: config.update(network_disabled=False, network_mode="bridge"),
            "read_only_system": lambda: config.update(read_only=False),
            "no_capabilities": lambda: config.update(cap_add=["SYS_PTRACE"]),
            "own_pid_namespace": lambda: config.update(pid_mode="host"),
            "clean_env": lambda: config.update(environment=host_env),
            "no_host_env": lambda: config.update(environment=host_env),
            "memory_limit": lambda: config.update(mem_limit=config["mem_limit"] * 8,
                                                  memswap_limit=config["memswap_limit"] * 8),
            "pids_limit": lambda: config.update(pids_limit=config["pids_limit"] * 16),
            "cpu_limit": lambda: config.pop("nano_cpus"),
            "disk_limit": lambda: config.update(shm_size=config["shm_size"] * 8, tmpfs={
                d: o.replace(f"size={self.tmpfs_mb}m", f"size={self.tmpfs_mb * 8}m")
                for d, o in config["tmpfs"].items()}),
            "private_tmp": lambda: config.update(tmpfs={}, volumes=[f"{self._shared_tmp}:/tmp",
                                                                   f"{self._shared_tmp}:/var/tmp"]),
            "only_scratch_writable": lambda: config["tmpfs"].update({"/data": config["tmpfs"]["/tmp"]}),  # never wiped
            "fd_limit": lambda: config.update(ulimits=[Ulimit(name="nofile", soft=8192, hard=8192),
                                                       Ulimit(name="core", soft=0, hard=0)]),
            "isolated_mode": lambda: None,  # in agent_argv
        }
        for name in sorted(self.weaken & set(changes)):
            changes[name]()
        return config

    async def spawn(self) -> Worker:
        name = self.new_name("verl-sbx")
        try:
            container = await self._call(self._docker.containers.create, name=name,
                                         **self._config(agent_argv(weaken=self.weaken)))
        except DOCKER_ERRORS as e:
            raise OSError(f"docker backend: creating {name} failed: {e}") from e
        proc = None
        try:
            proc = await AttachedContainer.open(container)  # before the start: no output is missed
            await self._call(container.start)
        except BaseException as e:
            if proc is not None:
                proc.kill()
            with contextlib.suppress(*DOCKER_ERRORS):
                await self._call(container.remove, force=True)
            if isinstance(e, DOCKER_ERRORS):
                raise OSError(f"docker backend: starting {name} failed: {e}") from e
            raise

        async def destroy() -> None:
            try:
                await self._call(container.remove, force=True)
                proc.removed = True
            except docker.errors.NotFound:
                proc.removed = True
            except DOCKER_ERRORS as e:  # the stale-container sweep (same instance id) removes it later
                logger.warning("docker backend: removing %s failed: %s", name, e)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(proc.wait(), 10)  # the attach stream ends with the container

        async def settle() -> None:  # ready: from now on it weighs what every other sandbox weighs
            try:
                await self._call(container.update, cpu_shares=CPU_SHARES)
            except DOCKER_ERRORS as e:
                raise OSError(f"docker backend: lowering the CPU weight of {name} failed: {e}") from e

        return Worker(name, proc, destroy, on_ready=settle, weaken=self.weaken)

    async def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, a blocking SDK call, in the backend's threads."""
        return await asyncio.get_running_loop().run_in_executor(self._calls, functools.partial(fn, *args, **kwargs))

    def remove_stale(self) -> int:
        """Remove runner containers with this backend's instance id (never another server's)."""
        return remove_containers(self.instance_id, self._docker)

    async def close(self) -> None:
        await self._call(self.remove_stale)
        self._calls.shutdown(wait=False)
        self._docker.close()
        if self._shared_tmp:
            shutil.rmtree(self._shared_tmp, ignore_errors=True)


class AttachedContainer:
    """A created container's stdin and stdout over one Engine API attach connection, shaped like the
    asyncio Process a Worker drives (``stdin``, ``stdout``, ``returncode``, ``wait``, ``kill``)."""

    def __init__(self, container: Container, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.container = container
        self.stdin = writer
        self.stdout = asyncio.StreamReader(limit=READ_LIMIT)
        self.returncode: int | None = None
        self.removed = False  # set once the backend has removed the container: its exit code is gone with it
        self._pump = asyncio.ensure_future(self._demux(reader))

    @classmethod
    async def open(cls, container: Container) -> AttachedContainer:
        reader, writer = await asyncio.open_unix_connection(docker_socket())
        # the SDK's attach is a blocking socket: this one request is written here, and read in the event loop
        writer.write(f"POST /containers/{container.id}/attach?stream=1&stdin=1&stdout=1&stderr=1 HTTP/1.1\r\n"
                     "Host: docker\r\nConnection: Upgrade\r\nUpgrade: tcp\r\nContent-Length: 0\r\n\r\n".encode())
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        if head.split(b" ", 2)[1:2] not in ([b"101"], [b"200"]):
            writer.close()
            raise OSError(f"docker backend: attaching to {container.name} failed: "
                          f"{head.decode(errors='replace').strip()}")
        return cls(container, reader, writer)

    async def _demux(self, reader: asyncio.StreamReader) -> None:
        """Without a TTY Docker frames the output: 1 byte stream (1 stdout, 2 stderr), 3 zero bytes, a
        4-byte big-endian length, the bytes. Stdout goes on; stderr (the agent's own tracebacks) is dropped,
        as the process backend drops it."""
        try:
            while True:
                header = await reader.readexactly(8)
                payload = await reader.readexactly(int.from_bytes(header[4:8], "big"))
                if header[0] == 1:
                    self.stdout.feed_data(payload)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the container ended (or was removed)
        finally:
            self.stdout.feed_eof()
            self.stdin.close()

    async def wait(self) -> int:
        """The agent's exit code once its container has ended; -9 when the container was removed first."""
        await asyncio.shield(self._pump)
        if self.returncode is None and self.removed:
            self.returncode = -9
        if self.returncode is None:
            try:  # returns at once for an ended container; NotFound for a removed one
                done = await asyncio.to_thread(self.container.wait, condition="not-running")
                code = done.get("StatusCode")
            except (*DOCKER_ERRORS, ValueError):
                code = None
            self.returncode = -9 if code is None else int(code)
        return self.returncode

    def kill(self) -> None:
        """Drop the connection: the container's stdin closes (the agent exits on end of input), and the
        output stream ends here."""
        self.stdin.close()
