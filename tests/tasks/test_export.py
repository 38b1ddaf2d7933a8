"""verl_agent.tasks.export: task images as one bundle (`tasks export`), loaded with no Docker (`tasks import`),
and a task's rootfs found through the store's task index (`rootfs_for`), on one examples/terminal_tasks task."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from task_helpers import make_task, needs_docker

from verl_agent.containers.images import ImageStore
from verl_agent.tasks.image import ImageError, environment_hash
from verl_agent.data.harbor import TaskError, load_task

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "terminal_tasks" / "tasks" / "train" / "count-00"


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> tuple[Path, dict]:
    import docker

    from verl_agent.tasks.bases import ensure_bases
    from verl_agent.tasks.export import export_tasks

    ensure_bases(tags=["debian:bookworm-slim"])
    out = tmp_path_factory.mktemp("bundle")
    return out, export_tasks(EXAMPLE, out, docker.from_env(), level=3)  # level 19 is for real bundles


@needs_docker
@pytest.mark.docker
def test_export_import_gives_the_tasks_rootfs_without_docker(bundle, tmp_path, capsys):
    from verl_agent.cli import main
    from verl_agent.tasks.export import rootfs_for

    out, res = bundle
    task = load_task(EXAMPLE)
    env_hash = environment_hash(task.environment_dir)
    index = json.loads((out / "index.json").read_text())
    assert index["tasks"] == {env_hash: {"ref": res["refs"][0], "tasks": ["count-00"]}} and len(res["refs"]) == 1
    assert res["archive_bytes"] < res["tar_bytes"] / 2
    assert main(["tasks", "import", str(out), "--store", str(tmp_path / "store")]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["refs"] == res["refs"] and line["bytes"] > 50e6
    store = ImageStore(tmp_path / "store")
    img = rootfs_for(task, store)  # no client: through the task index
    assert img.ref == res["refs"][0] and img.workdir == "/app" and (img.rootfs / "app").is_dir()
    passwd = (img.rootfs / "etc/passwd").read_text()
    assert any(line.startswith("agent:x:1000:") for line in passwd.splitlines())
    assert (img.rootfs / "app").stat().st_uid == 1000 and not (img.rootfs / "tests").exists()


@needs_docker
@pytest.mark.docker
def test_rootfs_for_builds_and_exports_with_docker_and_says_how_to_bring_images_without(bundle, tmp_path):
    import docker

    from verl_agent.tasks.export import rootfs_for

    _, res = bundle
    task = load_task(EXAMPLE)
    with pytest.raises(ImageError, match=r"no image for this environment .*no Docker here.*`verl-agent tasks "
                                         r"export TASKS_DIR --out BUNDLE`.*`verl-agent tasks import BUNDLE`"):
        rootfs_for(task, ImageStore(tmp_path / "empty"))
    store = ImageStore(tmp_path / "store")
    img = rootfs_for(task, store, docker.from_env())  # the image exists (the export built it): saved, loaded
    assert img.ref == res["refs"][0] and (img.rootfs / "app").is_dir()
    assert rootfs_for(task, ImageStore(tmp_path / "store")) == img  # now recorded in the task index


def test_import_refuses_what_is_not_a_bundle(tmp_path):
    from verl_agent.tasks.export import discover_tasks, import_bundle

    with pytest.raises(ImageError, match=r"index.json: not a task image bundle .*tasks export"):
        import_bundle(tmp_path, ImageStore(tmp_path / "store"))
    with pytest.raises(TaskError, match="no task directories under it"):
        discover_tasks(tmp_path)
    make_task(tmp_path / "a" / "deeper")
    shutil.copytree(EXAMPLE, tmp_path / "b" / EXAMPLE.name)
    assert [p.name for p in discover_tasks(tmp_path)] == ["count-lines", "count-00"]


def test_rootfs_for_a_prebuilt_docker_image_uses_its_ref(tmp_path):
    """``[environment] docker_image``: the ref itself is looked up in the store (no Docker here)."""
    import hashlib
    import io
    import tarfile

    from verl_agent.tasks.export import rootfs_for

    def tar(files: dict[str, bytes]) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as t:
            for name, data in files.items():
                info = tarfile.TarInfo(name)
                info.size = len(data)
                t.addfile(info, io.BytesIO(data))
        return buf.getvalue()

    layer = tar({"app/hello.txt": b"hi\n"})
    config = json.dumps({"rootfs": {"type": "layers", "diff_ids": [f"sha256:{hashlib.sha256(layer).hexdigest()}"]},
                         "config": {"WorkingDir": "/app", "User": "1000"}}).encode()
    manifest = json.dumps([{"Config": "c.json", "RepoTags": ["prebuilt:1"], "Layers": ["l/layer.tar"]}]).encode()
    (tmp_path / "prebuilt.tar").write_bytes(tar({"l/layer.tar": layer, "c.json": config, "manifest.json": manifest}))
    task_dir = shutil.copytree(EXAMPLE, tmp_path / "prebuilt-task")
    (task_dir / "task.toml").write_text((task_dir / "task.toml").read_text() + 'docker_image = "prebuilt:1"\n')
    task = load_task(task_dir)
    store = ImageStore(tmp_path / "store")
    with pytest.raises(ImageError, match=r"docker_image 'prebuilt:1' is not in the image store .*tasks import"):
        rootfs_for(task, store)
    store.load_archive(tmp_path / "prebuilt.tar")
    img = rootfs_for(task, store)
    assert (img.ref, img.user, img.workdir) == ("prebuilt:1", "1000", "/app")
    assert (img.rootfs / "app/hello.txt").read_text() == "hi\n"
