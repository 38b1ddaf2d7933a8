"""``verl-agent sandbox serve | up | down | build-image`` (wired into verl_agent/cli.py).

``serve`` runs the server in the foreground (``--min-pool-size`` warm sandboxes, grown on demand up
to ``--max-pool-size``). ``up``/``down`` run it as a compose service (``docker/compose.yaml``) from
images built offline (``image.py``); ``build-image`` builds the runner image alone."""

from __future__ import annotations

import argparse
import logging
import shutil
import subprocess
from importlib import resources
from typing import Any

from verl_agent.sandbox.api import DEFAULT_MEMORY_MB, DEFAULT_PORT
from verl_agent.sandbox.backends.base import SandboxBackend
from verl_agent.sandbox.service import ServiceSettings

logger = logging.getLogger(__name__)

__all__ = ["add_cli", "compose_down", "compose_up", "make_backend", "run_cli", "serve"]


def make_backend(name: str = "auto", image: str | None = None, memory_mb: int = DEFAULT_MEMORY_MB,
                 instance_id: str | None = None) -> SandboxBackend:
    """``docker``, ``process``, or ``auto`` (docker when the daemon and image are there, else process).

    ``instance_id`` names what this server leaves behind (docker: a container label; process: a cgroup
    directory); a server started with the id of a crashed one removes what that one left, and only that."""
    from verl_agent.sandbox.backends.docker import DEFAULT_IMAGE, DockerBackend, docker_available
    from verl_agent.sandbox.backends.process import ProcessBackend

    if name == "auto":
        name = "docker" if docker_available() else "process"
    if name == "docker":
        return DockerBackend(image=image or DEFAULT_IMAGE, memory_mb=memory_mb, instance_id=instance_id)
    if name == "process":
        return ProcessBackend(memory_mb=memory_mb, instance_id=instance_id)
    raise ValueError(f"sandbox backend must be 'docker', 'process' or 'auto', got {name!r}")


def serve(backend: str = "auto", host: str = "127.0.0.1", port: int = DEFAULT_PORT, image: str | None = None,
          log_level: str = "info", instance_id: str | None = None, **settings: Any) -> None:
    """Run the server in the foreground; ``settings`` are ``ServiceSettings`` fields (validated)."""
    import uvicorn

    from verl_agent.sandbox.server import create_app
    from verl_agent.sandbox.service import SandboxService

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        sandbox_backend = make_backend(backend, image, instance_id=instance_id)
    except (ValueError, RuntimeError) as e:  # a bad id, no docker/bwrap, a guarantee that does not hold
        raise SystemExit(f"verl-agent sandbox serve: {e}") from e
    service = SandboxService(sandbox_backend, ServiceSettings(**settings))
    uvicorn.run(create_app(service), host=host, port=port, log_level=log_level)


COMPOSE_PROJECT = "verl-agent-sandbox"


def compose_command() -> list[str]:
    """``docker compose`` (the plugin) where present, else Debian's ``docker-compose`` (1.29)."""
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose") is not None:
        return ["docker-compose"]
    raise SystemExit("neither `docker compose` nor `docker-compose` is installed (scripts/setup_docker.sh "
                     "installs Debian's docker-compose); or run `verl-agent sandbox serve`")


def _compose(project: str, env: dict[str, str], *args: str) -> int:
    import os

    with resources.as_file(resources.files("verl_agent.sandbox") / "docker" / "compose.yaml") as path:
        env = {**os.environ, "VERL_AGENT_SANDBOX_PORT": str(DEFAULT_PORT), **env}  # `down` needs it set too
        return subprocess.call([*compose_command(), "-p", project, "-f", str(path), *args], env=env)


def compose_up(port: int = DEFAULT_PORT, instance_id: str = "compose", project: str = COMPOSE_PROJECT,
               min_pool_size: int = ServiceSettings.min_pool_size, max_pool_size: int = ServiceSettings.max_pool_size,
               wait_s: float = 180.0) -> str:
    """Build the images offline, start the server with compose, wait until it answers; returns its URL."""
    import time

    import httpx

    from verl_agent.sandbox.image import ensure_images

    ServiceSettings(min_pool_size=min_pool_size, max_pool_size=max_pool_size)  # validate before starting
    env = {"VERL_AGENT_SANDBOX_SERVER_IMAGE": ensure_images(server=True), "VERL_AGENT_SANDBOX_PORT": str(port),
           "VERL_AGENT_SANDBOX_INSTANCE": instance_id, "VERL_AGENT_SANDBOX_MIN_POOL_SIZE": str(min_pool_size),
           "VERL_AGENT_SANDBOX_MAX_POOL_SIZE": str(max_pool_size)}
    if _compose(project, env, "up", "-d") != 0:
        raise SystemExit(f"compose up failed (project {project})")
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/v1/ping", timeout=2).json() == "pong":
                return url
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise SystemExit(f"the sandbox server did not answer on {url} within {wait_s:.0f} s "
                     f"(docker logs {project}_server_1, or `docker compose -p {project} logs`)")


def compose_down(instance_id: str = "compose", project: str = COMPOSE_PROJECT) -> int:
    """Stop the compose server, then remove any runner container it left (its instance id only)."""
    from verl_agent.sandbox.backends.docker import remove_containers

    rc = _compose(project, {"VERL_AGENT_SANDBOX_INSTANCE": instance_id}, "down", "--timeout", "60")
    remove_containers(instance_id)
    return rc


def add_cli(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser("sandbox", help="the local Sandbox Fusion compatible code sandbox")
    sub = p.add_subparsers(dest="sandbox_cmd", required=True)
    s = sub.add_parser("serve", help="run the sandbox server in the foreground")
    s.add_argument("--backend", default="auto", choices=["auto", "docker", "process"])
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=DEFAULT_PORT)
    d = ServiceSettings()
    s.add_argument("--min-pool-size", "--pool-size", dest="min_pool_size", type=int, default=d.min_pool_size,
                   help=f"warm sandboxes kept ready (default {d.min_pool_size}; --pool-size is an alias)")
    s.add_argument("--max-pool-size", type=int, default=None,
                   help=f"the pool grows on demand up to this many sandboxes (default max({d.max_pool_size}, "
                        "--min-pool-size))")
    s.add_argument("--pool-idle-timeout", type=float, default=d.pool_idle_timeout,
                   help="the pool shrinks to the peak demand of the last this-many seconds (not below "
                        "--min-pool-size)")
    s.add_argument("--max-queue", type=int, default=d.max_queue,
                   help="requests allowed to wait for a sandbox; more are answered 503 + Retry-After")
    s.add_argument("--queue-timeout", type=float, default=d.queue_timeout,
                   help="seconds a request may wait for a sandbox before a 503")
    s.add_argument("--crash-respawn-rate", type=float, default=d.crash_respawn_rate,
                   help="a client that broke more than --crash-respawn-burst sandboxes within burst/rate seconds "
                        "gets a sandbox at most this many times a second (the others are not slowed)")
    s.add_argument("--crash-respawn-burst", type=int, default=d.crash_respawn_burst,
                   help="sandbox breaks a client may cause at full speed before its back-off starts")
    s.add_argument("--instance-id", default=None,
                   help="this server's id (letters, digits, '-'); it removes only what a server with this id "
                        "left behind (default: a fresh random id)")
    s.add_argument("--image", default=None)
    s.add_argument("--log-level", default="info")
    b = sub.add_parser("build-image", help="build the runner image offline (debootstrap + docker import)")
    b.add_argument("--force", action="store_true", help="rebuild even if the images exist")
    up = sub.add_parser("up", help="build the images offline, `docker compose up -d` the server, wait for it")
    up.add_argument("--port", type=int, default=DEFAULT_PORT, help="the server listens on 127.0.0.1:PORT")
    up.add_argument("--min-pool-size", type=int, default=d.min_pool_size)
    up.add_argument("--max-pool-size", type=int, default=d.max_pool_size)
    down = sub.add_parser("down", help="docker compose down, then remove the runner containers it left")
    for q in (up, down):
        q.add_argument("--instance-id", default="compose", help="the server's instance id (container label)")
        q.add_argument("--project", default=COMPOSE_PROJECT, help="the compose project name")


def run_cli(args: argparse.Namespace) -> int:
    if args.sandbox_cmd == "serve":
        max_pool = args.max_pool_size if args.max_pool_size is not None else max(
            ServiceSettings.max_pool_size, args.min_pool_size)
        try:
            ServiceSettings(min_pool_size=args.min_pool_size, max_pool_size=max_pool,
                            pool_idle_timeout=args.pool_idle_timeout, max_queue=args.max_queue,
                            queue_timeout=args.queue_timeout, crash_respawn_rate=args.crash_respawn_rate,
                            crash_respawn_burst=args.crash_respawn_burst)
        except ValueError as e:
            raise SystemExit(f"verl-agent sandbox serve: {e}") from e
        serve(args.backend, args.host, args.port, args.image, args.log_level, args.instance_id,
              min_pool_size=args.min_pool_size, max_pool_size=max_pool, pool_idle_timeout=args.pool_idle_timeout,
              max_queue=args.max_queue, queue_timeout=args.queue_timeout,
              crash_respawn_rate=args.crash_respawn_rate, crash_respawn_burst=args.crash_respawn_burst)
        return 0
    if args.sandbox_cmd == "build-image":
        from verl_agent.sandbox.image import ensure_images

        logging.basicConfig(level="INFO")
        print(ensure_images(force=args.force))
        return 0
    if args.sandbox_cmd == "up":
        logging.basicConfig(level="INFO")
        url = compose_up(args.port, args.instance_id, args.project, args.min_pool_size, args.max_pool_size)
        print(f"sandbox server up at {url} (Sandbox Fusion API); stop it with `verl-agent sandbox down`")
        return 0
    if args.sandbox_cmd == "down":
        return compose_down(args.instance_id, args.project)
    raise ValueError(f"unknown sandbox command {args.sandbox_cmd!r}")


def main(argv: list[str] | None = None) -> int:
    """``python -m verl_agent.sandbox.cli build-image`` works before the lead wires the CLI."""
    parser = argparse.ArgumentParser(prog="verl-agent")
    add_cli(parser.add_subparsers(dest="cmd", required=True))
    return run_cli(parser.parse_args(["sandbox", *(argv if argv is not None else __import__("sys").argv[1:])]))


if __name__ == "__main__":
    raise SystemExit(main())
