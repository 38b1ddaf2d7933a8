"""Build the images offline: debootstrap a Debian rootfs and ``docker import`` it; runner and server on top.

No registry is reachable on our machines, so ``FROM debian`` cannot be pulled. Instead the base
image is made from the Debian apt mirror (python3, bash, g++, nodejs; about a minute), a ``sandbox``
user (uid 10001) is added, apt caches are dropped, and the tree is imported. The Dockerfile in
``docker/`` then builds the runner on top of it via ``--build-arg BASE_IMAGE=...``.

The server image (for ``verl-agent sandbox up``) is the runner image plus what the server needs,
all taken from this machine, no download: the ``verl_agent`` sandbox package and what it imports of ours
(the container layer, the registry), the installed
distributions it imports (fastapi, uvicorn, httpx, pydantic, the ``docker`` SDK, with which it starts runner
containers through the mounted Docker socket, and their dependencies, copied from this interpreter's
site-packages; the base image's python3 has the same minor version). Its tag carries a hash of those
files, so a changed server is rebuilt and an unchanged one is reused (seconds).
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
import tempfile
from importlib import resources
from pathlib import Path

logger = logging.getLogger(__name__)

__all__ = ["BASE_IMAGE", "PACKAGES", "RUNNER_IMAGE", "SERVER_IMAGE", "build_base", "build_runner", "build_server",
           "ensure_images", "image_exists"]

BASE_IMAGE = "verl-agent-sandbox-base:bookworm"
RUNNER_IMAGE = "verl-agent-sandbox-runner:latest"
SERVER_IMAGE = "verl-agent-sandbox-server"  # tagged with a content hash, and :latest
SERVER_DISTS = ["fastapi", "uvicorn", "httpx", "pydantic", "docker"]  # what verl_agent.sandbox imports to serve
PACKAGES = ["python3", "g++", "nodejs", "ca-certificates"]
MIRROR = "http://deb.debian.org/debian"


def image_exists(name: str) -> bool:
    """True when the docker CLI is there and knows the image ``name``."""
    if shutil.which("docker") is None:
        return False
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


def ensure_images(force: bool = False, server: bool = False) -> str:
    """Build base and runner images (and the server image with ``server``) when missing or when
    ``force``; returns the runner name, or the server's hashed tag with ``server``."""
    if force or not image_exists(BASE_IMAGE):
        build_base()
    if force or not image_exists(RUNNER_IMAGE):
        build_runner()
    return build_server(force=force) if server else RUNNER_IMAGE


def _dist_closure(names: list[str]) -> list:
    """The installed distributions ``names`` need at run time (extras and absent optional ones skipped)."""
    from importlib import metadata

    seen: dict[str, metadata.Distribution] = {}
    todo = list(names)
    while todo:
        key = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if key in seen:
            continue
        try:
            dist = metadata.distribution(key)
        except metadata.PackageNotFoundError:
            continue  # a requirement behind a marker that does not apply here (e.g. python_version < 3.11)
        seen[key] = dist
        for req in dist.requires or []:
            if "extra ==" in req.replace("extra==", "extra =="):
                continue
            m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
            if m:
                todo.append(m.group(1))
    return list(seen.values())


def _stage_server(ctx: Path) -> str:
    """Copy what the server image needs into ``ctx``; returns a hash of it all."""
    import hashlib
    import sys

    if sys.version_info[:2] != (3, 11):
        raise RuntimeError(f"the server image copies this interpreter's packages into the runner image's "
                           f"Python 3.11; run `verl-agent sandbox up` from a Python 3.11 environment "
                           f"(this is {sys.version.split()[0]})")
    digest = hashlib.sha256()
    site = ctx / "site-packages"
    files: list[tuple[Path, Path]] = []
    for dist in sorted(_dist_closure(SERVER_DISTS), key=lambda d: d.metadata["Name"].lower()):
        for rel in dist.files or []:
            src = Path(dist.locate_file(rel))
            if rel.parts[0] == ".." or "__pycache__" in rel.parts or not src.is_file():
                continue  # console scripts outside site-packages, byte code
            files.append((src, site / rel))
    pkg = resources.files("verl_agent")
    with resources.as_file(pkg) as root:
        root = Path(root)
        # the sandbox and what it may import (tests/test_layering.py): the container layer and the registry
        for single in ("__init__.py", "registry.py"):
            files.append((root / single, site / "verl_agent" / single))
        for part in ("sandbox", "containers"):
            for src in sorted((root / part).rglob("*")):
                if src.is_file() and "__pycache__" not in src.parts:
                    files.append((src, site / "verl_agent" / src.relative_to(root)))
        for src, dst in files:
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
            digest.update(str(dst.relative_to(ctx)).encode() + b"\0" + src.read_bytes())
    dockerfile = (pkg / "sandbox" / "docker" / "server.Dockerfile").read_bytes()
    (ctx / "server.Dockerfile").write_bytes(dockerfile)
    digest.update(dockerfile + image_id(RUNNER_IMAGE).encode())
    return digest.hexdigest()[:12]


def image_id(name: str) -> str:
    out = subprocess.run(["docker", "image", "inspect", "-f", "{{.Id}}", name], capture_output=True, text=True)
    return out.stdout.strip()


def build_server(force: bool = False) -> str:
    """Build (or reuse) the server image on top of the runner image; returns its hashed tag."""
    with tempfile.TemporaryDirectory(prefix="verl-sbx-server-") as tmp:
        ctx = Path(tmp)
        tag = f"{SERVER_IMAGE}:{_stage_server(ctx)}"
        if force or not image_exists(tag):
            _run(["docker", "build", "-q", "--build-arg", f"BASE_IMAGE={RUNNER_IMAGE}", "-t", tag, "-t",
                  f"{SERVER_IMAGE}:latest", "-f", str(ctx / "server.Dockerfile"), str(ctx)],
                 stdout=subprocess.DEVNULL, env=_legacy_builder_env())
        else:
            _run(["docker", "tag", tag, f"{SERVER_IMAGE}:latest"])
    listed = subprocess.run(["docker", "image", "ls", "--format", "{{.Repository}}:{{.Tag}}", SERVER_IMAGE],
                            capture_output=True, text=True).stdout.split()
    stale = [t for t in listed if t not in (tag, f"{SERVER_IMAGE}:latest")]
    if stale:  # earlier builds of the server (our repository name only); a running one keeps its layers
        subprocess.run(["docker", "image", "rm", *stale], capture_output=True)
    return tag
