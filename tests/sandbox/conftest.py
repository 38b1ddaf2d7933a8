"""Real sandbox servers on loopback: one per backend, started once per test session in a thread.

The docker backend needs a running daemon and the runner image (scripts/setup_docker.sh). Without
them its tests skip -- except in CI (CI=true), where a missing Docker is a failure.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn

from verl_agent.sandbox.server import create_app
from verl_agent.sandbox.service import SandboxService, ServiceSettings


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """uvicorn serving a SandboxService on 127.0.0.1:<free port> in a daemon thread."""

    def __init__(self, backend, settings: ServiceSettings, max_body_bytes: int = 8 << 20) -> None:
        self.service = SandboxService(backend, settings)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(create_app(self.service, max_body_bytes=max_body_bytes), host="127.0.0.1",
                                port=self.port, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 120
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("sandbox server did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(60)

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Wait until no request runs and the warm minimum is idle (recycled ones replaced)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pool = httpx.get(f"{self.url}/v1/health").json()["pool"]
            if pool["busy"] == pool["starting"] == 0 and pool["idle"] >= pool["min_pool_size"]:
                return
            time.sleep(0.05)
        raise AssertionError("workers were not replaced in time")


def docker_ready() -> bool:
    from verl_agent.sandbox.backends.docker import DEFAULT_IMAGE, docker_available
    from verl_agent.sandbox.image import image_exists

    ok = docker_available() and image_exists(DEFAULT_IMAGE)
    if not ok and os.environ.get("CI") == "true":
        pytest.fail("CI=true but Docker or the runner image is missing (run scripts/setup_docker.sh)")
    return ok


SETTINGS = dict(min_pool_size=3, max_pool_size=6, max_queue=64, queue_timeout=60.0, max_output_bytes=64 << 10,
                default_memory_mb=256, max_memory_mb=512, max_sessions=4, session_idle_timeout=300.0)


@pytest.fixture(scope="session")
def process_server() -> Iterator[ServerThread]:
    from verl_agent.sandbox.backends.process import ProcessBackend

    backend = ProcessBackend(memory_mb=512, pids=64, tmpfs_mb=32)
    with ServerThread(backend, ServiceSettings(**SETTINGS)) as server:
        yield server


@pytest.fixture(scope="session")
def docker_server() -> Iterator[ServerThread]:
    if not docker_ready():
        pytest.skip("Docker or the runner image is missing (scripts/setup_docker.sh)")
    from verl_agent.sandbox.backends.docker import DockerBackend

    backend = DockerBackend(memory_mb=512, pids=64, tmpfs_mb=32)
    with ServerThread(backend, ServiceSettings(**SETTINGS)) as server:
        yield server


@pytest.fixture(scope="session")
def docker_backend_cls():
    """DockerBackend, for tests that start their own docker server (skips without Docker, fails in CI)."""
    if not docker_ready():
        pytest.skip("Docker or the runner image is missing (scripts/setup_docker.sh)")
    from verl_agent.sandbox.backends.docker import DockerBackend

    return DockerBackend


@pytest.fixture(scope="module")
def weak_server(request):
    """``weak_server(backend, weakening)``: a server like ``server``'s on a sandbox without that one protection
    (the backends' test-only ``weaken``; "a+b": both; ``body_limit``: the HTTP server's body limit at 64 MiB). One at a
    time: each is started when first asked for and stopped when another (or ``fresh``) is (callers ask in groups).
    Each weakening runs under a uid of its own: without a PID namespace kill(-1) reaches every process
    of that uid."""
    from verl_agent.sandbox.backends.probe import WEAKENINGS

    held: dict = {}

    def stop() -> None:
        if "server" in held:
            held.pop("server").__exit__(None, None, None)
            held.pop("key")

    def get(backend: str, weakening: str, fresh: bool = False) -> ServerThread:
        if fresh or held.get("key") != (backend, weakening):
            stop()
            if backend == "docker":
                cls = request.getfixturevalue("docker_backend_cls")
            else:
                from verl_agent.sandbox.backends.process import ProcessBackend as cls
            weaken = frozenset(weakening.split("+")) - {"body_limit"}
            names = list(WEAKENINGS) + ["body_limit"]
            uid = 31001 + sum(names.index(w) for w in weakening.split("+"))
            sandbox = cls(memory_mb=512, pids=64, tmpfs_mb=32, uid=uid, weaken=weaken)
            assert not any(sandbox.guarantees().get(w, False) for w in weaken), "the probe must see the weakening"
            settings = ServiceSettings(**{**SETTINGS, "min_pool_size": 1})
            body = 64 << 20 if weakening == "body_limit" else 8 << 20
            server = ServerThread(sandbox, settings, max_body_bytes=body).__enter__()
            held.update(key=(backend, weakening), server=server)
        return held["server"]

    yield get
    stop()


@pytest.fixture(params=["process", "docker"], scope="session")
def server(request) -> ServerThread:
    """Each test using this runs against both backends."""
    return request.getfixturevalue(f"{request.param}_server")


def run_code(server: ServerThread, code: str, language: str = "python", timeout: float = 60.0, **fields) -> dict:
    """POST /run_code and return the JSON body (asserting HTTP 200)."""
    body = {"code": code, "language": language, **fields}
    response = httpx.post(f"{server.url}/run_code", json=body, timeout=timeout)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="session")
def run():
    return run_code


@pytest.fixture(scope="session")
def server_thread_cls() -> type[ServerThread]:
    """ServerThread for tests that start their own server (`from conftest import` is ambiguous across folders)."""
    return ServerThread
