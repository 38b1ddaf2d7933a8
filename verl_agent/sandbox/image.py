"""Build the runner image offline: debootstrap a Debian rootfs and ``docker import`` it.

No registry is reachable on our machines, so ``FROM debian`` cannot be pulled. Instead the base
image is made from the Debian apt mirror (python3, bash, g++, nodejs; about a minute), a ``sandbox``
user (uid 10001) is added, apt caches are dropped, and the tree is imported. The Dockerfile in
``docker/`` then builds the runner on top of it via ``--build-arg BASE_IMAGE=...``.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

logger = logging.getLogger(__name__)

__all__ = ["BASE_IMAGE", "PACKAGES", "RUNNER_IMAGE", "build_base", "build_runner", "image_exists"]

BASE_IMAGE = "verl-agent-sandbox-base:bookworm"
RUNNER_IMAGE = "verl-agent-sandbox-runner:latest"
PACKAGES = ["python3", "g++", "nodejs", "ca-certificates"]
MIRROR = "http://deb.debian.org/debian"


def image_exists(name: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", name], capture_output=True).returncode == 0


def _run(argv: list[str], **kwargs) -> None:
    logger.info("$ %s", " ".join(argv))
    subprocess.run(argv, check=True, **kwargs)


def build_base(name: str = BASE_IMAGE, suite: str = "bookworm", mirror: str = MIRROR) -> str:
    """debootstrap + docker import; returns the image name."""
    if shutil.which("debootstrap") is None:
        raise RuntimeError("build-image needs debootstrap: apt-get install -y debootstrap")
    with tempfile.TemporaryDirectory(prefix="verl-sbx-rootfs-") as tmp:
        root = Path(tmp) / "rootfs"
        _run(["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", suite, str(root), mirror],
             stdout=subprocess.DEVNULL)
        with open(root / "etc/passwd", "a") as f:
            f.write("sandbox:x:10001:10001:sandbox:/tmp:/usr/sbin/nologin\n")
        with open(root / "etc/group", "a") as f:
            f.write("sandbox:x:10001:\n")
        for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
            shutil.rmtree(root / cache, ignore_errors=True)
        tar = subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE)
        _run(["docker", "import", "--change", "USER 10001:10001", "--change", "WORKDIR /tmp", "-", name],
             stdin=tar.stdout, stdout=subprocess.DEVNULL)
        if tar.wait() != 0:
            raise RuntimeError("tar of the rootfs failed")
    return name


def build_runner(name: str = RUNNER_IMAGE, base: str = BASE_IMAGE) -> str:
    """``docker build`` the runner Dockerfile on top of the offline base image."""
    context = resources.files("verl_agent.sandbox") / "docker"
    with resources.as_file(context) as ctx:
        _run(["docker", "build", "-q", "--build-arg", f"BASE_IMAGE={base}", "-t", name, "-f",
              str(Path(ctx) / "Dockerfile"), str(ctx)], stdout=subprocess.DEVNULL, env=_legacy_builder_env())
    return name


def _legacy_builder_env() -> dict:
    # BuildKit tries to resolve FROM images in a registry even when they exist locally; the classic
    # builder uses the local image. Drop once Docker's BuildKit honours local-only images offline.
    import os

    return {**os.environ, "DOCKER_BUILDKIT": "0"}


def ensure_images(force: bool = False) -> str:
    """Build base and runner images when missing (or when ``force``); returns the runner name."""
    if force or not image_exists(BASE_IMAGE):
        build_base()
    if force or not image_exists(RUNNER_IMAGE):
        build_runner()
    return RUNNER_IMAGE
