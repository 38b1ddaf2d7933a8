"""verl_agent.containers.images: image archives -> flat root filesystems with no Docker daemon.

Real ``docker save`` archives of tiny images (a handful of files made with ``docker import``: dash, rm and
mkdir with their libraries, plus files of every kind; children that delete and replace files, so their
layers carry whiteouts), the same images as an OCI layout written here from the docker-save layers
(Docker 20.10 cannot save OCI), hand-made archives for what Docker never writes (path traversal, an
opaque directory over a symlink, damaged layers), and one examples/terminal_tasks task end to end:
export -> import -> rootfs.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from verl_agent.containers.images import ImageStore, ImageStoreError, normalize_ref, tree_bytes

ROOT = Path(__file__).resolve().parents[2]
TAG = "verl-agent-test-tiny"


def _docker_ready() -> bool:
    from verl_agent.sandbox.backends.docker import docker_available

    ok = docker_available()
    if not ok and os.environ.get("CI") == "true":
        pytest.fail("CI=true but Docker is missing (scripts/setup_docker.sh)")
    return ok


# ---------------------------------------------------------------------------------------------------------
# Tars and archives written here


def _add(tar: tarfile.TarFile, name: str, data: bytes | None = None, **fields) -> None:
    info = tarfile.TarInfo(name)
    for key, value in {"mode": 0o644, "mtime": 1_700_000_000, **fields}.items():
        setattr(info, key, value)
    if data is not None:
        info.size = len(data)
    tar.addfile(info, io.BytesIO(data) if data is not None else None)


def _tar(build) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        build(tar)
    return buf.getvalue()


def _host_binaries(tar: tarfile.TarFile) -> None:
    """dash, rm, mkdir and the libraries they load, at the paths ldd names: enough for a Dockerfile RUN."""
    out = subprocess.run(["ldd", "/bin/dash", "/bin/rm", "/bin/mkdir"], capture_output=True, text=True).stdout
    libs = {w for line in out.splitlines() for w in line.split() if w.startswith("/") and ":" not in w}
    for path in sorted(libs) + ["/bin/dash", "/bin/rm", "/bin/mkdir"]:
        _add(tar, path.lstrip("/"), Path(os.path.realpath(path)).read_bytes(), mode=0o755)
    _add(tar, "bin/sh", type=tarfile.SYMTYPE, linkname="dash", mode=0o777)


def _tiny_rootfs(tar: tarfile.TarFile) -> None:
    _host_binaries(tar)
    _add(tar, "etc/passwd", b"root:x:0:0:root:/root:/bin/sh\nu:x:1000:1000::/home/u:/bin/sh\n")
    _add(tar, "data", type=tarfile.DIRTYPE, mode=0o755)
    _add(tar, "data/keep.txt", b"keep\n")
    _add(tar, "data/hard", type=tarfile.LNKTYPE, linkname="data/keep.txt")
    _add(tar, "data/gone.txt", b"gone\n")
    for name in ("data/dir_gone/x.txt", "data/opq/a.txt", "data/opq/b.txt"):
        _add(tar, name, b"lower\n")
    _add(tar, "data/fifo", type=tarfile.FIFOTYPE)
    _add(tar, "data/null", type=tarfile.CHRTYPE, devmajor=1, devminor=3, mode=0o666)
    _add(tar, "link", type=tarfile.SYMTYPE, linkname="/data/keep.txt", mode=0o777)
    _add(tar, "usr/bin/suid", b"#!/bin/sh\n", mode=0o4755)
    _add(tar, "home/u", type=tarfile.DIRTYPE, mode=0o700, uid=1000, gid=1000)
    _add(tar, "home/u/secret", b"s\n", mode=0o600, uid=1000, gid=1000)


CHILD = """\
FROM {base}
RUN ["/bin/rm", "-rf", "/data/gone.txt", "/data/dir_gone"]
RUN ["/bin/sh", "-c", "rm -rf /data/opq && mkdir /data/opq && echo new > /data/opq/c.txt"]
ENV GREETING=hello
USER 1000
WORKDIR /home/u
"""
SIBLING = """\
FROM {base}
RUN ["/bin/sh", "-c", "echo sibling > /data/sibling.txt"]
"""


def _docker(*argv: str, stdin: bytes | None = None) -> str:
    return subprocess.run(["docker", *argv], input=stdin, capture_output=True, check=True).stdout.decode().strip()


def _build(tmp: Path, name: str, dockerfile: str) -> str:
    ctx = tmp / name
    ctx.mkdir()
    (ctx / "Dockerfile").write_text(dockerfile)
    _docker("build", "-q", "-t", f"{TAG}:{name}", str(ctx))
    return f"{TAG}:{name}"


def _docker_save_archive(tmp: Path, images: list[tuple[list[str], list[bytes], dict]]) -> Path:
    """A docker-save style archive written by hand (for what Docker would never write)."""
    path = tmp / f"handmade-{len(list(tmp.glob('handmade-*')))}.tar"

    def build(tar: tarfile.TarFile) -> None:
        manifest = []
        for i, (tags, layers, extra) in enumerate(images):
            names = []
            for j, layer in enumerate(layers):
                names.append(f"img{i}-l{j}/layer.tar")
                _add(tar, names[-1], layer)
            config = {"rootfs": {"type": "layers", "diff_ids": [f"sha256:{hashlib.sha256(x).hexdigest()}"
                                                                for x in layers]}, "config": {}, **extra}
            _add(tar, f"config{i}.json", json.dumps(config).encode())
            manifest.append({"Config": f"config{i}.json", "RepoTags": tags, "Layers": names})
        _add(tar, "manifest.json", json.dumps(manifest).encode())

    path.write_bytes(_tar(build))
    return path


def _oci_layout(save_tar: Path, dest: Path) -> None:
    """The images of a docker-save tar as an OCI image layout directory: first layer gzip, the others zstd."""
    import zstandard

    blobs = dest / "blobs" / "sha256"
    blobs.mkdir(parents=True)

    def put(data: bytes) -> str:
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        return f"sha256:{digest}"

    manifests = []
    with tarfile.open(save_tar) as tar:
        def read(name: str) -> bytes:
            return tar.extractfile(tar.getmember(name)).read()  # type: ignore[union-attr]
        for item in json.loads(read("manifest.json")):
            layers = []
            for j, name in enumerate(item["Layers"]):
                raw = read(name)
                packed = gzip.compress(raw, 1) if j == 0 else zstandard.ZstdCompressor().compress(raw)
                kind = "gzip" if j == 0 else "zstd"
                layers.append({"mediaType": f"application/vnd.oci.image.layer.v1.tar+{kind}",
                               "digest": put(packed), "size": len(packed)})
            config = read(item["Config"])
            manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": put(config),
                                   "size": len(config)}, "layers": layers}
            body = json.dumps(manifest).encode()
            name = f"example.com/{item['RepoTags'][0]}"
            manifests.append({"mediaType": manifest["mediaType"], "digest": put(body), "size": len(body),
                              "annotations": {"org.opencontainers.image.ref.name": name}})
    (dest / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (dest / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": manifests}))


# ---------------------------------------------------------------------------------------------------------
# Fixtures: the tiny images, built and saved once for the module


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    if not _docker_ready():
        pytest.skip("needs Docker")
    tmp = tmp_path_factory.mktemp("tiny")
    base = f"{TAG}:base"
    _docker("import", "--change", "CMD [\"/bin/sh\"]", "-", base, stdin=_tar(_tiny_rootfs))
    child = _build(tmp, "child", CHILD.format(base=base))
    sibling = _build(tmp, "sibling", SIBLING.format(base=base))
    archive = tmp / "tiny.tar"
    _docker("save", "-o", str(archive), child, sibling)
    yield {"tmp": tmp, "archive": archive, "child": child, "sibling": sibling, "base": base}
    subprocess.run(["docker", "image", "rm", child, sibling, base], capture_output=True)


@pytest.fixture(scope="module")
def loaded(tiny) -> tuple[ImageStore, list[str], float]:
    store = ImageStore(tiny["tmp"] / "store")
    t0 = time.perf_counter()
    refs = store.load_archive(tiny["archive"])
    return store, refs, time.perf_counter() - t0


def _listing(rootfs: Path) -> dict[str, tuple]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(rootfs):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            out[os.path.relpath(path, rootfs)] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_uid,
                                                  st.st_size if stat.S_ISREG(st.st_mode) else 0)
    return out


# ---------------------------------------------------------------------------------------------------------
# docker save archives


@pytest.mark.docker
def test_docker_save_archive_gives_the_images_files_and_config(tiny, loaded):
    store, refs, _ = loaded
    assert sorted(refs) == sorted([tiny["child"], tiny["sibling"]]) and store.refs() == sorted(refs)
    img = store.get(tiny["child"])
    assert img is not None and (img.user, img.workdir) == ("1000", "/home/u") and img.env["GREETING"] == "hello"
    r = img.rootfs
    assert (r / "data/keep.txt").read_text() == "keep\n"
    # whiteouts of a file and a directory, and a directory emptied and made again (opaque on overlay2)
    assert not (r / "data/gone.txt").exists() and not (r / "data/dir_gone").exists()
    assert sorted(os.listdir(r / "data/opq")) == ["c.txt"] and (r / "data/opq/c.txt").read_text() == "new\n"
    # modes, owners, links and special files as in the image
    assert stat.S_IMODE((r / "usr/bin/suid").stat().st_mode) == 0o4755
    home, secret = (r / "home/u").stat(), (r / "home/u/secret").lstat()
    assert (stat.S_IMODE(home.st_mode), home.st_uid) == (0o700, 1000)
    assert (stat.S_IMODE(secret.st_mode), secret.st_uid, secret.st_gid) == (0o600, 1000, 1000)
    assert os.readlink(r / "link") == "/data/keep.txt" and os.readlink(r / "bin/sh") == "dash"
    assert (r / "data/hard").stat().st_ino == (r / "data/keep.txt").stat().st_ino
    assert stat.S_ISFIFO((r / "data/fifo").lstat().st_mode)
    null = (r / "data/null").lstat()
    assert stat.S_ISCHR(null.st_mode) and (os.major(null.st_rdev), os.minor(null.st_rdev)) == (1, 3)
    # the sibling shares the base layer but not the child's deletions
    sib = store.get(tiny["sibling"]).rootfs  # type: ignore[union-attr]
    assert (sib / "data/gone.txt").exists() and sorted(os.listdir(sib / "data/opq")) == ["a.txt", "b.txt"]
    assert (sib / "data/sibling.txt").read_text() == "sibling\n"


@pytest.mark.docker
def test_the_rootfs_is_what_docker_runs(tiny, loaded):
    """Every path, type, mode, owner and size of the rootfs equals the image's, as `docker export` gives it."""
    store, _, _ = loaded
    container = _docker("create", tiny["child"], "/bin/sh")
    try:
        out = subprocess.run(["docker", "export", container], capture_output=True, check=True).stdout
    finally:
        subprocess.run(["docker", "rm", container], capture_output=True)
    container_only = {".dockerenv", "etc", "etc/hostname", "etc/hosts", "etc/resolv.conf", "etc/mtab", "proc", "sys"}
    want = {}
    with tarfile.open(fileobj=io.BytesIO(out)) as tar:
        for m in tar:
            name = m.name.removeprefix("./").rstrip("/")
            if name and name not in container_only and name != "dev" and not name.startswith("dev/"):
                want[name] = m
    got = _listing(store.get(tiny["child"]).rootfs)  # type: ignore[union-attr]
    got = {k: v for k, v in got.items() if k not in container_only}
    assert set(got) == set(want)
    for name, m in want.items():
        if not m.islnk():
            assert got[name][1:3] == ((m.mode & 0o7777) if not m.issym() else 0o777, m.uid), name


@pytest.mark.docker
def test_layers_shared_between_images_are_stored_once(tiny, loaded):
    store, _, _ = loaded
    layers = sorted(p.name for p in (store.root / "layers").iterdir())
    assert len(layers) == 4  # base + child's two + sibling's one
    child, sib = store.get(tiny["child"]).rootfs, store.get(tiny["sibling"]).rootfs  # type: ignore[union-attr]
    dash = (child / "bin/dash").stat()
    assert dash.st_ino == (sib / "bin/dash").stat().st_ino and dash.st_nlink == 3  # the layer's file + 2 images
    seen: set = set()
    layer_bytes = tree_bytes(store.root / "layers", seen)
    assert tree_bytes(child, seen) == tree_bytes(sib, seen) == 0  # the rootfs trees add only directories and links
    assert tree_bytes(child) + tree_bytes(sib) > 1.9 * layer_bytes  # what two plain copies would take


@pytest.mark.docker
def test_second_load_is_instant_and_compressed_archives_reuse_layers(tiny, loaded):
    import zstandard

    store, refs, first = loaded
    t0 = time.perf_counter()
    assert store.load_archive(tiny["archive"]) == refs
    again = time.perf_counter() - t0
    assert again < 0.1 and again < first / 3, (again, first)  # about 1 ms: a stat and two small JSON reads
    layers = {p.name: p.stat().st_ino for p in (store.root / "layers").iterdir()}
    raw = tiny["archive"].read_bytes()
    for name, packed in (("tiny.tar.zst", zstandard.ZstdCompressor().compress(raw)),
                         ("tiny.tar.gz", gzip.compress(raw, 1))):
        (tiny["tmp"] / name).write_bytes(packed)
        assert sorted(store.load_archive(tiny["tmp"] / name)) == sorted(refs)
    # cached by content: the compressed copies unpacked no layer again
    assert {p.name: p.stat().st_ino for p in (store.root / "layers").iterdir()} == layers


@pytest.mark.docker
def test_oci_layout_directory_and_tar(tiny, loaded):
    store, _, _ = loaded
    layout = tiny["tmp"] / "oci"
    _oci_layout(tiny["archive"], layout)
    oci_tar = tiny["tmp"] / "oci.tar"
    with tarfile.open(oci_tar, "w") as tar:
        tar.add(layout, arcname=".")
    for source in (layout, oci_tar):
        fresh = ImageStore(tiny["tmp"] / f"store-{source.name}")
        refs = fresh.load_archive(source)
        assert sorted(refs) == sorted(f"example.com/{r}" for r in (tiny["child"], tiny["sibling"]))
        img = fresh.get(f"example.com/{tiny['child']}")
        assert img is not None and img.user == "1000"
        assert _listing(img.rootfs) == _listing(store.get(tiny["child"]).rootfs)  # type: ignore[union-attr]


@pytest.mark.docker
def test_concurrent_processes_load_one_archive_safely(tiny):
    root = tiny["tmp"] / "store-concurrent"
    code = ("import json, sys; from verl_agent.containers.images import ImageStore; "
            "print(json.dumps(sorted(ImageStore(sys.argv[1]).load_archive(sys.argv[2]))))")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(root), str(tiny["archive"])], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT) for _ in range(3)]
    outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [err[-500:] for _, err in outs]
    assert len({out for out, _ in outs}) == 1
    assert len(list((root / "images").iterdir())) == 2 and len(list((root / "layers").iterdir())) == 4
    assert list((root / "tmp").iterdir()) == []
    assert (ImageStore(root).get(tiny["child"]).rootfs / "data/opq/c.txt").exists()  # type: ignore[union-attr]


@pytest.mark.docker
def test_from_docker_exports_a_local_image(tiny, loaded):
    import docker

    client = docker.from_env()
    store = ImageStore(tiny["tmp"] / "store-from-docker")
    img = store.from_docker(client, tiny["sibling"])
    assert img.ref == tiny["sibling"] and (img.rootfs / "data/sibling.txt").read_text() == "sibling\n"
    image_dirs = list((store.root / "images").iterdir())
    t0 = time.perf_counter()
    again = store.from_docker(client, tiny["sibling"])  # the same image id: no second docker save
    assert again == img and time.perf_counter() - t0 < 0.5 and list((store.root / "images").iterdir()) == image_dirs
    with pytest.raises(ImageStoreError, match=r"verl-agent-test-tiny:absent: not a local Docker image.*docker load"):
        store.from_docker(client, f"{TAG}:absent")


# ---------------------------------------------------------------------------------------------------------
# Hand-made archives: layer semantics Docker rarely writes, and what it never writes


def test_whiteouts_opaque_dirs_and_replaced_types(tmp_path):
    def lower(tar):
        _add(tar, "a", type=tarfile.DIRTYPE, mode=0o750, uid=7)
        _add(tar, "a/x", b"x")
        _add(tar, "a/sub/y", b"y")
        _add(tar, "f_then_dir", b"file")
        _add(tar, "dir_then_f/z", b"z")
        _add(tar, "lib", type=tarfile.SYMTYPE, linkname="usr/lib")
        _add(tar, "usr/lib/keep", b"k")
        _add(tar, "w/gone", b"g")

    def upper(tar):
        _add(tar, "a/.wh..wh..opq", b"")
        _add(tar, "a/new", b"n")  # "a" only implied: it keeps the lower mode and owner
        _add(tar, "f_then_dir/inner", b"i")
        _add(tar, "dir_then_f", b"now a file")
        _add(tar, "w/.wh.gone", b"")
        _add(tar, "lib/.wh.keep", b"")  # under a symlink: hides nothing below (not a directory there)

    archive = _docker_save_archive(tmp_path, [(["hand:made"], [_tar(lower), _tar(upper)], {})])
    store = ImageStore(tmp_path / "store")
    r = store.get(store.load_archive(archive)[0]).rootfs  # type: ignore[union-attr]
    assert sorted(os.listdir(r / "a")) == ["new"]
    assert (stat.S_IMODE((r / "a").stat().st_mode), (r / "a").stat().st_uid) == (0o750, 7)
    assert (r / "f_then_dir/inner").read_text() == "i" and (r / "dir_then_f").read_text() == "now a file"
    assert os.listdir(r / "w") == [] and (r / "usr/lib/keep").exists()
    assert not (r / "lib").is_symlink() and os.listdir(r / "lib") == []  # overlay2: the upper directory wins


@pytest.mark.parametrize("member, kind, message", [
    ("../escape", "file", r"member '\.\./escape' has a '\.\.' component: refused"),
    ("/abs", "file", r"member '/abs' has an absolute name: refused"),
    ("sneaky/../../escape", "file", r"has a '\.\.' component: refused"),
    ("via/escape", "symlink-parent", r"member 'via/escape' goes through 'via', a symlink of the same layer"),
    ("hard", "hardlink-out", r"hard link 'hard': member '\.\./\.\./etc/passwd' has a '\.\.' component: refused"),
    ("hard", "hardlink-dir", r"hard link 'hard' -> 'd' does not name an earlier file of the same layer"),
])
def test_path_traversal_is_refused(tmp_path, member, kind, message):
    def layer(tar):
        if kind == "symlink-parent":
            _add(tar, "via", type=tarfile.SYMTYPE, linkname=str(tmp_path))
        if kind == "hardlink-dir":
            _add(tar, "d", type=tarfile.DIRTYPE)
        if kind.startswith("hardlink"):
            _add(tar, member, type=tarfile.LNKTYPE, linkname="../../etc/passwd" if kind == "hardlink-out" else "d")
        else:
            _add(tar, member, b"pwned")

    archive = _docker_save_archive(tmp_path, [(["evil:1"], [_tar(layer)], {})])
    store = ImageStore(tmp_path / "store")
    with pytest.raises(ImageStoreError, match=message):
        store.load_archive(archive)
    assert not (tmp_path / "escape").exists() and not Path("/abs").exists()
    assert store.refs() == [] and list((store.root / "images").iterdir()) == []


def test_archive_names_leaving_the_layout_and_damaged_layers_are_refused(tmp_path):
    layout = tmp_path / "layout"
    layout.mkdir()
    (layout / "manifest.json").write_text(json.dumps([{"Config": "../secret.json", "Layers": []}]))
    (tmp_path / "secret.json").write_text("{}")
    with pytest.raises(ImageStoreError, match=r"member '\.\./secret\.json' has a '\.\.' component"):
        ImageStore(tmp_path / "s1").load_archive(layout)
    layer = _tar(lambda tar: _add(tar, "f", b"data"))
    archive = _docker_save_archive(tmp_path, [(["bad:1"], [layer], {})])
    damaged = archive.read_bytes().replace(b"data", b"DATA")
    archive.write_bytes(damaged)
    with pytest.raises(ImageStoreError, match=r"layer img0-l0/layer.tar: its content has digest sha256:.*again"):
        ImageStore(tmp_path / "s2").load_archive(archive)
    (tmp_path / "not-an-image.tar").write_bytes(_tar(lambda tar: _add(tar, "hello.txt", b"hi")))
    with pytest.raises(ImageStoreError, match=r"neither manifest.json .* nor index.json .*: not an image archive"):
        ImageStore(tmp_path / "s3").load_archive(tmp_path / "not-an-image.tar")


def test_refs_and_task_index(tmp_path):
    assert normalize_ref("docker.io/library/debian:bookworm-slim") == "debian:bookworm-slim"
    assert normalize_ref("ubuntu") == "ubuntu:latest" and normalize_ref("ghcr.io/a/b:1") == "ghcr.io/a/b:1"
    store = ImageStore(tmp_path / "store")
    assert store.get("nothing:here") is None and store.task_ref("0" * 64) is None
    store.set_task_ref("0" * 64, "docker.io/library/x")
    assert ImageStore(tmp_path / "store").task_ref("0" * 64) == "x:latest"


def test_unprivileged_load_keeps_modes_and_skips_owners_and_devices(tmp_path):
    """Not root (setpriv to nobody): modes kept, files owned by the caller, device nodes left out."""
    import tempfile

    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run a loader as nobody")

    def layer(tar):
        _add(tar, "ro", type=tarfile.DIRTYPE, mode=0o555)
        _add(tar, "ro/secret", b"s", mode=0o600, uid=1000, gid=1000)
        _add(tar, "suid", b"x", mode=0o4755)
        _add(tar, "null", type=tarfile.CHRTYPE, devmajor=1, devminor=3)

    work = Path(tempfile.mkdtemp(prefix="verl-images-nobody-"))
    try:
        os.chmod(work, 0o777)
        archive = _docker_save_archive(work, [(["nobody:1"], [_tar(layer)], {})])
        os.chmod(archive, 0o644)
        code = ("import sys; from verl_agent.containers.images import ImageStore; "
                "ImageStore(sys.argv[1]).load_archive(sys.argv[2])")
        out = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
                              code, str(work / "store"), str(archive)], capture_output=True, text=True, cwd=ROOT)
        assert out.returncode == 0, out.stderr[-1000:]
        assert "not running as root, so file owners are not kept" in out.stderr
        r = ImageStore(work / "store").get("nobody:1").rootfs  # type: ignore[union-attr]
        modes = {n: (stat.S_IMODE((r / n).lstat().st_mode), (r / n).lstat().st_uid)
                 for n in ("ro", "ro/secret", "suid")}
        assert modes == {"ro": (0o555, 65534), "ro/secret": (0o600, 65534), "suid": (0o4755, 65534)}
        assert not (r / "null").exists()
    finally:
        shutil.rmtree(work)
