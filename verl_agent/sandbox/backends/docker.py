"""``docker`` backend: one long-lived runner container per warm worker, the agent as its PID 1.

The container is created, attached and started through the Docker Engine API on the daemon's socket;
the agent speaks over the attached stdin/stdout (``AttachedContainer``), so a run costs no ``docker
exec``, nothing is created on the request path, and no ``docker`` CLI process stays beside each sandbox
(each would hold host memory and add to every start). Every container: no network (its own network
namespace with only loopback), a non-root
uid, ``CapDrop ALL``, ``no-new-privileges``, read-only root, size-limited tmpfs /tmp and /var/tmp owned by
the run uid, memory/pids/CPU limits, private IPC, no log driver (output never lands on the host disk),
and only Docker's own PATH/HOSTNAME/HOME in its env.

Why the Engine API and not ``docker run --network none``: that gives every container a prestart hook
that re-executes the whole dockerd binary (``libnetwork-setkey``), a large share of the CPU a container
start costs. ``NetworkDisabled``, which only the API sets, keeps the empty network namespace and drops
the hook, so a burst of starts finishes sooner. A container also starts at a high CPU weight
(``STARTING_CPU_SHARES``) and drops to Docker's default once its agent is ready: in a burst, the starts
would otherwise share the cores equally with every sandbox already running a user's code.

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
import json
import logging
import os
import shutil
import subprocess
import uuid
from typing import Any

import httpx

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


def docker_socket() -> str:
    """The daemon's unix socket: ``DOCKER_HOST`` when it names one, else Docker's default path."""
    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    if not host.startswith("unix://"):
        raise RuntimeError(f"docker backend: DOCKER_HOST={host!r} is not a unix socket (the only kind supported)")
    return host[len("unix://"):]


def docker_available(timeout: float = 10.0) -> bool:
    """True when the docker CLI exists and the daemon answers."""
    if shutil.which("docker") is None:
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=timeout).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def remove_containers(instance_id: str) -> int:
    """Remove the runner containers labelled with ``instance_id`` (and no other); returns how many."""
    found = subprocess.run(["docker", "ps", "-aq", "--filter", f"label={SERVER_LABEL}={instance_id}"],
                           capture_output=True, text=True)
    ids = found.stdout.split()
    if ids:
        subprocess.run(["docker", "rm", "-f", *ids], capture_output=True)
        logger.info("removed %d sandbox containers of instance %s", len(ids), instance_id)
    return len(ids)


class DockerBackend(SandboxBackend):
    name = "docker"

    def __init__(self, image: str = DEFAULT_IMAGE, uid: int = 10001, memory_mb: int = DEFAULT_MEMORY_MB, pids: int = 128,
                 cpus: float = 1.0, tmpfs_mb: int = 64, instance_id: str | None = None,
                 weaken: frozenset[str] = frozenset()):
        self.weaken = check_weaken("docker", weaken)  # test-only (probe.WEAKENINGS); never claimed
        if not docker_available():
            raise RuntimeError("docker backend: the docker daemon does not answer (run scripts/setup_docker.sh)")
        probe = subprocess.run(["docker", "image", "inspect", image], capture_output=True)
        if probe.returncode != 0:
            raise RuntimeError(f"docker backend: image {image!r} is missing (run `verl-agent sandbox build-image`)")
        self.image, self.uid, self.memory_mb, self.pids, self.cpus, self.tmpfs_mb = (
            image, uid, memory_mb, pids, cpus, tmpfs_mb)
        self.instance_id = instance_id or uuid.uuid4().hex
        if not self.instance_id.replace("-", "").isalnum():
            raise ValueError(f"docker backend: instance_id must be letters, digits and '-', got {instance_id!r}")
        self._shared_tmp = shared_tmp(self.weaken)  # weakened private_tmp only
        self._api: httpx.AsyncClient | None = None
        self._api_loop: asyncio.AbstractEventLoop | None = None
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
        done = None
        try:
            with httpx.Client(transport=httpx.HTTPTransport(uds=docker_socket()), base_url="http://docker",
                              timeout=60) as api:
                _created(api.post("/containers/create", params={"name": name},
                                  json=self._config(["/usr/bin/python3", "-I", "-c", PROBE, json.dumps(want)])),
                         name)
            done = subprocess.run(["docker", "start", "-a", name], capture_output=True, text=True, timeout=120)
            found = parse_probe(done.stdout)
        except (OSError, httpx.HTTPError, subprocess.TimeoutExpired, ValueError, IndexError, TypeError) as e:
            why = (done is not None and done.stderr.strip()[-300:]) or f"{type(e).__name__}: {e}"
            raise IsolationError(f"docker backend: the isolation probe did not run ({why}); refusing to serve") from e
        finally:
            subprocess.run(["docker", "rm", "-f", name], capture_output=True)
        judge("docker", found, set(GUARANTEES) - unclaimed(self.weaken))  # docker claims every one not weakened
        logger.info("docker backend %s: every guarantee probed and holds: %s", self.instance_id, sorted(found))
        return found

    def languages(self) -> list[str]:
        return list(LANGUAGES)  # the runner image carries python3, bash, gcc/g++ and nodejs

    def _config(self, cmd: list[str]) -> dict[str, Any]:
        """The Engine API's create body: the runner's isolation, in one place (probe and workers)."""
        uid = f"{self.uid}"
        tmpfs = f"rw,exec,nosuid,nodev,size={self.tmpfs_mb}m,uid={uid},gid={uid},mode=0700"
        config = {
            "Image": self.image, "Cmd": cmd, "User": f"{uid}:{uid}", "WorkingDir": "/tmp", "Hostname": "sandbox",
            "Labels": {"verl-agent.sandbox": "1", SERVER_LABEL: self.instance_id},
            "AttachStdin": True, "AttachStdout": True, "AttachStderr": True, "OpenStdin": True, "StdinOnce": True,
            "NetworkDisabled": True,  # a network namespace of its own, and no libnetwork hook at start
            "HostConfig": {
                "NetworkMode": "none", "LogConfig": {"Type": "none", "Config": {}},
                "CapDrop": ["ALL"], "SecurityOpt": ["no-new-privileges"], "ReadonlyRootfs": True,
                "IpcMode": "private", "Tmpfs": {"/tmp": tmpfs, "/var/tmp": tmpfs}, "ShmSize": self.tmpfs_mb << 20,
                "Memory": self.memory_mb << 20, "MemorySwap": self.memory_mb << 20, "PidsLimit": self.pids,
                "NanoCpus": int(self.cpus * 1e9), "CpuShares": STARTING_CPU_SHARES,
                "Ulimits": [{"Name": "nofile", "Soft": 1024, "Hard": 1024}, {"Name": "core", "Soft": 0, "Hard": 0}],
            },
        }
        return self._weakened(config) if self.weaken else config

    def _weakened(self, config: dict[str, Any]) -> dict[str, Any]:
        """Test-only: ``config`` without the guarantees in ``weaken`` (limits raised to a bounded multiple)."""
        weak, host = self.weaken, config["HostConfig"]
        changes = {
            "non_root_uid": lambda: config.update(User="0:0"),
            "no_network": lambda: (config.update(NetworkDisabled=False), host.update(NetworkMode="bridge")),
            "read_only_system": lambda: host.update(ReadonlyRootfs=False),
            "no_capabilities": lambda: host.update(CapAdd=["SYS_PTRACE"]),
            "own_pid_namespace": lambda: host.update(PidMode="host"),
            "clean_env": lambda: config.update(Env=[f"{k}={v}" for k, v in os.environ.items()]),
            "no_host_env": lambda: config.update(Env=[f"{k}={v}" for k, v in os.environ.items()]),
            "memory_limit": lambda: host.update(Memory=host["Memory"] * 8, MemorySwap=host["MemorySwap"] * 8),
            "pids_limit": lambda: host.update(PidsLimit=host["PidsLimit"] * 16),
            "cpu_limit": lambda: host.update(NanoCpus=0),
            "disk_limit": lambda: host.update(ShmSize=host["ShmSize"] * 8, Tmpfs={
                d: o.replace(f"size={self.tmpfs_mb}m", f"size={self.tmpfs_mb * 8}m")
                for d, o in host["Tmpfs"].items()}),
            "private_tmp": lambda: (host.update(Tmpfs={}), host.update(Binds=[f"{self._shared_tmp}:/tmp",
                                                                              f"{self._shared_tmp}:/var/tmp"])),
            "only_scratch_writable": lambda: host["Tmpfs"].update({"/data": host["Tmpfs"]["/tmp"]}),  # never wiped
            "fd_limit": lambda: host.update(Ulimits=[{"Name": "nofile", "Soft": 8192, "Hard": 8192},
                                                     {"Name": "core", "Soft": 0, "Hard": 0}]),
            "isolated_mode": lambda: None,  # in agent_argv
        }
        for name in sorted(weak & set(changes)):
            changes[name]()
        return config

    async def spawn(self) -> Worker:
        name = self.new_name("verl-sbx")
        api = self._client()
        try:
            _created(await api.post("/containers/create", params={"name": name},
                                    json=self._config(agent_argv(weaken=self.weaken))),
                     name)
        except httpx.HTTPError as e:
            raise OSError(f"docker backend: creating {name} failed: {e}") from e
        proc = None
        try:
            proc = await AttachedContainer.open(name, api)  # before the start: no output is missed
            started = await api.post(f"/containers/{name}/start")
            if started.status_code != 204:
                raise OSError(f"docker backend: starting {name} failed: HTTP {started.status_code} {started.text}")
        except BaseException as e:
            if proc is not None:
                proc.kill()
            with contextlib.suppress(httpx.HTTPError):
                await api.delete(f"/containers/{name}", params={"force": "1"})
            if isinstance(e, httpx.HTTPError):
                raise OSError(f"docker backend: starting {name} failed: {e}") from e
            raise

        async def destroy() -> None:
            try:
                await self._client().delete(f"/containers/{name}", params={"force": "1"})
            except httpx.HTTPError as e:  # the stale-container sweep (same instance id) removes it later
                logger.warning("docker backend: removing %s failed: %s", name, e)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(proc.wait(), 10)  # the attach stream ends with the container

        async def settle() -> None:  # ready: from now on it weighs what every other sandbox weighs
            try:
                done = await self._client().post(f"/containers/{name}/update", json={"CpuShares": CPU_SHARES})
            except httpx.HTTPError as e:
                raise OSError(f"docker backend: lowering the CPU weight of {name} failed: {e}") from e
            if done.status_code != 200:
                raise OSError(f"docker backend: lowering the CPU weight of {name} failed: HTTP {done.status_code}")

        return Worker(name, proc, destroy, on_ready=settle, weaken=self.weaken)

    def _client(self) -> httpx.AsyncClient:
        """The API client of the running event loop (a client's connections belong to the loop that made them)."""
        loop = asyncio.get_running_loop()
        if self._api is None or self._api_loop is not loop:
            self._api = httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=docker_socket()),
                                          base_url="http://docker", timeout=60)
            self._api_loop = loop
        return self._api

    def remove_stale(self) -> int:
        """Remove runner containers with this backend's instance id (never another server's)."""
        return remove_containers(self.instance_id)

    async def close(self) -> None:
        if self._api is not None and self._api_loop is asyncio.get_running_loop():
            await self._api.aclose()
        self._api = None
        await asyncio.to_thread(self.remove_stale)
        if self._shared_tmp:
            shutil.rmtree(self._shared_tmp, ignore_errors=True)


class AttachedContainer:
    """A created container's stdin and stdout over one Engine API attach connection, shaped like the
    asyncio Process a Worker drives (``stdin``, ``stdout``, ``returncode``, ``wait``, ``kill``)."""

    def __init__(self, name: str, api: httpx.AsyncClient, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter) -> None:  # fmt: skip
        self.name, self._api = name, api
        self.stdin = writer
        self.stdout = asyncio.StreamReader(limit=READ_LIMIT)
        self.returncode: int | None = None
        self._pump = asyncio.ensure_future(self._demux(reader))

    @classmethod
    async def open(cls, name: str, api: httpx.AsyncClient) -> AttachedContainer:
        reader, writer = await asyncio.open_unix_connection(docker_socket())
        # httpx does not hand over an upgraded connection, so this one request is written here
        writer.write(f"POST /containers/{name}/attach?stream=1&stdin=1&stdout=1&stderr=1 HTTP/1.1\r\n"
                     "Host: docker\r\nConnection: Upgrade\r\nUpgrade: tcp\r\nContent-Length: 0\r\n\r\n".encode())
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        if head.split(b" ", 2)[1:2] not in ([b"101"], [b"200"]):
            writer.close()
            raise OSError(f"docker backend: attaching to {name} failed: {head.decode(errors='replace').strip()}")
        return cls(name, api, reader, writer)

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
        if self.returncode is None:
            try:  # returns at once for an ended container; 404 for a removed one
                done = await self._api.post(f"/containers/{self.name}/wait", params={"condition": "not-running"})
                code = done.json().get("StatusCode") if done.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                code = None
            self.returncode = -9 if code is None else int(code)
        return self.returncode

    def kill(self) -> None:
        """Drop the connection: the container's stdin closes (the agent exits on end of input), and the
        output stream ends here."""
        self.stdin.close()


def _created(response: httpx.Response, name: str) -> None:
    if response.status_code != 201:
        raise OSError(f"docker backend: creating {name} failed: HTTP {response.status_code} {response.text.strip()}")
