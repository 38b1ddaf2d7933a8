"""Task images, built offline once per task content.

``ensure_image(task)`` returns the local image a task's containers start from:

* ``[environment] docker_image`` names a prebuilt image: it must exist locally (nothing is pulled).
* otherwise ``environment/Dockerfile`` is built by the Docker daemon with ``environment/`` as the
  context, tagged ``verl-agent-task:<hash>`` where the hash covers every file of ``environment/``
  (path, mode, bytes). A second run, or another trajectory of the same task, finds the tag and
  builds nothing; editing any file of ``environment/`` gives a new tag; tasks whose ``environment/``
  is identical share one image (and so one warm pool). The image is labelled with the first task
  that built it (``verl-agent.tasks.task``).

Every base image a ``FROM`` names must already be local: the build never pulls. A missing one fails
with an ``ImageError`` naming it and saying how to provide it (``verl-agent tasks build-bases`` makes
the common Debian-based ones offline). ``tests/`` and ``solution/`` are outside the build context, so
the image never contains the verifier or the oracle.
"""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path
from typing import Any

from verl_agent.data.harbor import HarborTask

__all__ = ["ImageError", "ensure_image", "environment_hash", "image_tag", "missing_bases"]

IMAGE_REPO = "verl-agent-task"
BASES_HINT = "`verl-agent tasks build-bases` builds debian:bookworm-slim and python:3.12-slim offline"
_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()


class ImageError(RuntimeError):
    """A task image cannot be provided (missing base image, failed build); the message says which and why."""


_hashes: dict[tuple, str] = {}


def environment_hash(env_dir: Path) -> str:
    """sha256 over every file under env_dir (relative path, executable bit, content), hex. Remembered
    per process while no file's size, mtime or mode changes (every trajectory asks; a large
    environment/ is read once)."""
    files = sorted(p for p in env_dir.rglob("*") if p.is_file())
    stats = [(p, p.stat()) for p in files]
    key = (str(env_dir), tuple((str(p), s.st_size, s.st_mtime_ns, s.st_mode) for p, s in stats))
    if key not in _hashes:
        h = hashlib.sha256()
        for p, st in stats:
            h.update(p.relative_to(env_dir).as_posix().encode() + b"\0")
            h.update(b"x" if st.st_mode & 0o111 else b"-")
            h.update(hashlib.sha256(p.read_bytes()).digest())
        _hashes[key] = h.hexdigest()
    return _hashes[key]


def image_tag(task: HarborTask, client: Any) -> str:
    """``verl-agent-task:<hash>``: the hash covers environment/ and the ids of the local images its
    Dockerfile starts FROM, so a rebuilt base image gives its tasks new images (a missing base counts as
    absent; building then refuses it)."""
    h = hashlib.sha256(environment_hash(task.environment_dir).encode())
    dockerfile = (task.environment_dir / "Dockerfile").read_text(encoding="utf-8")
    for image in _from_images(dockerfile):
        h.update(b"\0" + (_image_id(client, image) or "absent").encode())
    return f"{IMAGE_REPO}:{h.hexdigest()[:16]}"


def _from_images(dockerfile: str) -> list[str]:
    """Images named by FROM lines, minus earlier build stages, `scratch` and ones built from ARGs."""
    stages: set[str] = set()
    images: list[str] = []
    for line in dockerfile.splitlines():
        words = line.strip().split()
        if len(words) < 2 or words[0].upper() != "FROM":
            continue
        args = [w for w in words[1:] if not w.startswith("--")]
        if not args:
            continue
        image = args[0]
        if len(args) >= 3 and args[1].upper() == "AS":
            stages.add(args[2].lower())
        if image.lower() in stages or image == "scratch" or "$" in image or image in images:
            continue
        images.append(image)
    return images


def _image_id(client: Any, image: str) -> str | None:
    import docker.errors

    try:
        return client.images.get(image).id
    except docker.errors.ImageNotFound:
        return None


def _exists(client: Any, image: str) -> bool:
    return _image_id(client, image) is not None


def missing_bases(task: HarborTask, client: Any) -> list[str]:
    """Base images the task's Dockerfile needs that are not local."""
    dockerfile = (task.environment_dir / "Dockerfile").read_text(encoding="utf-8")
    return [image for image in _from_images(dockerfile) if not _exists(client, image)]


def _lock(tag: str) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault(tag, threading.Lock())


def ensure_image(task: HarborTask, client: Any = None, *, allow_internet: bool = False) -> str:
    """The task's local image (built if needed, once per content hash); raises ImageError."""
    import docker
    import docker.errors

    client = client or docker.from_env()
    if task.config.docker_image:
        if not _exists(client, task.config.docker_image):
            raise ImageError(f"{task.path / 'task.toml'}: docker_image {task.config.docker_image!r} is not a local "
                             "image and nothing is pulled: build or `docker load` it first")
        return task.config.docker_image
    tag = image_tag(task, client)
    with _lock(tag):
        if _exists(client, tag):
            return tag
        missing = missing_bases(task, client)
        if missing:
            raise ImageError(f"{task.environment_dir / 'Dockerfile'}: base image {', '.join(missing)} is not "
                             f"available locally and nothing is pulled; {BASES_HINT}, or build/`docker load` "
                             f"{'it' if len(missing) == 1 else 'them'} yourself")
        _build(client, task, tag, allow_internet)
        return tag


def _build(client: Any, task: HarborTask, tag: str, allow_internet: bool) -> None:
    import docker.errors

    log: list[str] = []
    try:
        stream = client.api.build(path=str(task.environment_dir), tag=tag, rm=True, forcerm=True, pull=False,
                                  decode=True, network_mode=None if allow_internet else "none",
                                  timeout=int(task.config.build_timeout_sec),
                                  labels={"verl-agent.tasks.task": task.name})
        for chunk in stream:
            if "stream" in chunk:
                log.append(chunk["stream"])
            if "error" in chunk:
                tail = "".join(log)[-1500:]
                raise ImageError(f"{task.environment_dir / 'Dockerfile'}: build failed: {chunk['error'].strip()}"
                                 f"\n--- build log (tail) ---\n{tail}")
    except docker.errors.APIError as e:
        raise ImageError(f"{task.environment_dir / 'Dockerfile'}: build failed: {e}") from e
    except Exception as e:  # the HTTP read timed out: build_timeout_sec
        if isinstance(e, ImageError):
            raise
        raise ImageError(f"{task.environment_dir / 'Dockerfile'}: build did not finish within "
                         f"build_timeout_sec={task.config.build_timeout_sec:g} ({type(e).__name__}: {e})") from e

