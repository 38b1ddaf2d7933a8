"""``verl-agent sandbox serve | up | down | build-image`` (wired into verl_agent/cli.py by the lead)."""

from __future__ import annotations

import argparse
import logging
import shutil
import subprocess
from importlib import resources

from verl_agent.sandbox.backends.base import SandboxBackend
from verl_agent.sandbox.service import ServiceSettings

logger = logging.getLogger(__name__)

__all__ = ["add_cli", "make_backend", "run_cli", "serve"]


def make_backend(name: str = "auto", image: str | None = None, memory_mb: int = 1024) -> SandboxBackend:
    """``docker``, ``process``, or ``auto`` (docker when the daemon and image are there, else process)."""
    from verl_agent.sandbox.backends.docker import DEFAULT_IMAGE, DockerBackend, docker_available
    from verl_agent.sandbox.backends.process import ProcessBackend

    if name == "auto":
        name = "docker" if docker_available() else "process"
    if name == "docker":
        return DockerBackend(image=image or DEFAULT_IMAGE, memory_mb=memory_mb)
    if name == "process":
        return ProcessBackend(memory_mb=memory_mb)
    raise ValueError(f"sandbox backend must be 'docker', 'process' or 'auto', got {name!r}")


def serve(backend: str = "auto", host: str = "127.0.0.1", port: int = 8080, pool_size: int = 4,
          image: str | None = None, max_queue: int = 64, log_level: str = "info") -> None:
    import uvicorn

    from verl_agent.sandbox.server import create_app
    from verl_agent.sandbox.service import SandboxService

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = ServiceSettings(pool_size=pool_size, max_queue=max_queue)
    service = SandboxService(make_backend(backend, image), settings)
    uvicorn.run(create_app(service), host=host, port=port, log_level=log_level)


def _compose(*args: str) -> int:
    compose = ["docker", "compose"] if _has_compose_plugin() else ["docker-compose"]
    if compose == ["docker-compose"] and shutil.which("docker-compose") is None:
        raise SystemExit("neither `docker compose` nor `docker-compose` is installed "
                         "(apt-get install -y docker-compose); or run `verl-agent sandbox serve`")
    with resources.as_file(resources.files("verl_agent.sandbox") / "docker" / "compose.yaml") as path:
        return subprocess.call([*compose, "-f", str(path), *args])


def _has_compose_plugin() -> bool:
    return subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0


def add_cli(subparsers) -> None:
    p = subparsers.add_parser("sandbox", help="the local Sandbox Fusion compatible code sandbox")
    sub = p.add_subparsers(dest="sandbox_cmd", required=True)
    s = sub.add_parser("serve", help="run the sandbox server in the foreground")
    s.add_argument("--backend", default="auto", choices=["auto", "docker", "process"])
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8080)
    s.add_argument("--pool-size", type=int, default=4)
    s.add_argument("--image", default=None)
    s.add_argument("--max-queue", type=int, default=64)
    s.add_argument("--log-level", default="info")
    b = sub.add_parser("build-image", help="build the runner image offline (debootstrap + docker import)")
    b.add_argument("--force", action="store_true", help="rebuild even if the images exist")
    sub.add_parser("up", help="docker compose up -d: build the runner image, start the server on 127.0.0.1:8080")
    sub.add_parser("down", help="docker compose down and remove leftover runner containers")


def run_cli(args: argparse.Namespace) -> int:
    if args.sandbox_cmd == "serve":
        serve(args.backend, args.host, args.port, args.pool_size, args.image, args.max_queue, args.log_level)
        return 0
    if args.sandbox_cmd == "build-image":
        from verl_agent.sandbox.image import ensure_images

        logging.basicConfig(level="INFO")
        print(ensure_images(force=args.force))
        return 0
    if args.sandbox_cmd == "up":
        from verl_agent.sandbox.image import ensure_images

        ensure_images()
        return _compose("up", "-d", "--build")
    if args.sandbox_cmd == "down":
        from verl_agent.sandbox.backends.docker import DockerBackend

        rc = _compose("down")
        DockerBackend.remove_stale()
        return rc
    raise ValueError(f"unknown sandbox command {args.sandbox_cmd!r}")


def main(argv: list[str] | None = None) -> int:
    """``python -m verl_agent.sandbox.cli build-image`` works before the lead wires the CLI."""
    parser = argparse.ArgumentParser(prog="verl-agent")
    add_cli(parser.add_subparsers(dest="cmd", required=True))
    return run_cli(parser.parse_args(["sandbox", *(argv if argv is not None else __import__("sys").argv[1:])]))


if __name__ == "__main__":
    raise SystemExit(main())
