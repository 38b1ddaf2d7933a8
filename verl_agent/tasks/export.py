"""Task images for hosts without a Docker daemon: one bundle written where Docker is, loaded where it is not.

``export_tasks(folder, out)`` (``verl-agent tasks export FOLDER --out DIR``) builds the image of every task
under ``folder`` (``ensure_image``, cached by content as always) and writes the bundle::

    DIR/images.tar.zst   ONE `docker save` of every image, zstd-compressed: a layer shared by several
                         images (the Debian and Python bases under every task) is in it once
    DIR/index.json       environment hash of each task's environment/ -> its image ref (and the task
                         names, for humans); images named by ``[environment] docker_image``

``import_bundle(DIR, store)`` (``verl-agent tasks import DIR``) loads the archive into an
``ImageStore`` (no daemon) and records each environment hash -> ref in the store's task index.
``rootfs_for(task, store)`` is what the daemonless runtime asks: the flat rootfs of a task's image,
found through that index; given a Docker client it builds and exports a missing one instead.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from verl_agent.containers.images import ImageStore, RootfsImage, normalize_ref
from verl_agent.data.harbor import HarborTask, TaskError, is_task_dir, load_task
from verl_agent.tasks.image import ImageError, ensure_image, environment_hash

__all__ = ["ARCHIVE", "INDEX", "discover_tasks", "export_tasks", "import_bundle", "rootfs_for"]

ARCHIVE = "images.tar.zst"
INDEX = "index.json"
BRING_HINT = ("export the images where Docker runs (`verl-agent tasks export TASKS_DIR --out BUNDLE`), copy "
              "BUNDLE here, then `verl-agent tasks import BUNDLE`")


def discover_tasks(folder: Path) -> list[Path]:
    """Every task directory under ``folder`` (itself, children, or deeper, e.g. ``train/`` and ``heldout/``)."""
    root = Path(folder)
    if is_task_dir(root):
        return [root]
    if not root.is_dir():
        raise TaskError(f"{root}: not a directory")
    found: list[Path] = []
    for dirpath, dirnames, _ in os.walk(root):
        if is_task_dir(Path(dirpath)):
            found.append(Path(dirpath))
            dirnames.clear()  # a task's own folders hold no tasks
    if not found:
        raise TaskError(f"{root}: no task directories under it (directories with task.toml)")
    return sorted(found)


def _save(client: Any, refs: list[str], archive: Path, level: int) -> int:
    """``docker save`` of all ``refs`` at once (the daemon writes each layer once), zstd-compressed into
    ``archive``; returns the uncompressed size. The SDK's ``get_image`` takes one name, so the
    multi-name endpoint is called through the same low-level client it uses."""
    import zstandard

    api = client.api
    res = api._get(api._url("/images/get"), params={"names": refs}, stream=True)
    api._raise_for_status(res)
    total = 0
    tmp = archive.with_name(f".{archive.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f, zstandard.ZstdCompressor(level=level, threads=-1).stream_writer(f) as z:
        for chunk in api._stream_raw_result(res, 1 << 20, False):
            z.write(chunk)
            total += len(chunk)
    os.replace(tmp, archive)
    return total


def export_tasks(folder: Path, out: Path, client: Any = None, *, level: int = 19) -> dict:
    """Build every task image under ``folder`` and write the bundle to ``out`` (see the module docstring).
    Returns the index written plus ``archive``, ``archive_bytes``, ``tar_bytes``, ``build_s``, ``save_s``."""
    import docker

    client = client or docker.from_env()
    t0 = time.perf_counter()
    built: dict[str, dict] = {}  # environment hash -> {"ref", "tasks"}
    direct: dict[str, list[str]] = {}  # [environment] docker_image -> tasks
    for d in discover_tasks(folder):
        task = load_task(d, allow_internet=None)
        ref = normalize_ref(ensure_image(task, client))
        if task.config.docker_image:
            direct.setdefault(ref, []).append(task.name)
        else:
            entry = built.setdefault(environment_hash(task.environment_dir), {"ref": ref, "tasks": []})
            entry["tasks"].append(task.name)
    refs = sorted({e["ref"] for e in built.values()} | set(direct))
    t1 = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tar_bytes = _save(client, refs, out / ARCHIVE, level)
    index = {"version": 1, "archive": ARCHIVE, "refs": refs, "tasks": built, "images": direct}
    (out / INDEX).write_text(json.dumps(index, indent=1, sort_keys=True))
    return {**index, "archive_bytes": (out / ARCHIVE).stat().st_size, "tar_bytes": tar_bytes,
            "build_s": round(t1 - t0, 2), "save_s": round(time.perf_counter() - t1, 2)}


def import_bundle(bundle_dir: Path, store: ImageStore) -> list[str]:
    """Load a bundle written by ``export_tasks`` into ``store`` and fill its task index; returns the refs."""
    bundle_dir = Path(bundle_dir)
    try:
        index = json.loads((bundle_dir / INDEX).read_text())
        archive, tasks = bundle_dir / index["archive"], index["tasks"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ImageError(f"{bundle_dir / INDEX}: not a task image bundle ({type(e).__name__}: {e}); "
                         f"{BRING_HINT}") from e
    refs = store.load_archive(archive)
    missing = sorted(set(index.get("refs", [])) - set(refs))
    if missing:
        raise ImageError(f"{archive}: lacks image(s) {missing} that {bundle_dir / INDEX} lists; export it again")
    for env_hash, entry in tasks.items():
        if store.task_ref(env_hash) != normalize_ref(entry["ref"]):
            store.set_task_ref(env_hash, entry["ref"])
    return refs


def rootfs_for(task: HarborTask, store: ImageStore, client: Any = None) -> RootfsImage:
    """The flat rootfs of ``task``'s image. With a Docker client: built (``ensure_image``, cached by content)
    and exported into the store when missing. Without: from the store's index, else ``ImageError``."""
    if task.config.docker_image:
        if client is not None:
            return store.from_docker(client, task.config.docker_image)  # cheap when that image id is stored
        found = store.get(task.config.docker_image)
        if found is None:
            raise ImageError(f"{task.path / 'task.toml'}: docker_image {task.config.docker_image!r} is not in the "
                             f"image store {store.root}; {BRING_HINT}")
        return found
    env_hash = environment_hash(task.environment_dir)
    if client is not None:
        tag = ensure_image(task, client)
        found = store.get(tag) or store.from_docker(client, tag)
        if store.task_ref(env_hash) != found.ref:
            store.set_task_ref(env_hash, found.ref)
        return found
    ref = store.task_ref(env_hash)
    found = store.get(ref) if ref else None
    if found is None:
        raise ImageError(f"{task.environment_dir}: no image for this environment (hash {env_hash[:16]}) in the "
                         f"image store {store.root}, and no Docker here to build it; {BRING_HINT}")
    return found
