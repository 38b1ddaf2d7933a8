"""Daemonless image store: container images as flat root filesystems, read from archives with no Docker daemon.

What it reads
    ``load_archive(path)`` takes a ``docker save`` tar (Docker's ``manifest.json`` layout, any version) or an
    OCI image layout (``oci-layout`` + ``index.json`` + ``blobs/``), as a tar file, plain, ``.gz`` or
    ``.zst`` (detected by content, not by name), or as an unpacked directory. Layers inside may be plain,
    gzip or zstd tars. ``from_docker(client, image)`` exports a local Docker image (the SDK's
    ``image.save()`` stream) and loads that.

Layout on disk (``$VERL_AGENT_IMAGES``, default ``$VERL_AGENT_CACHE/images``, that is ``~/.cache/verl_agent/images``)::

    layers/<diff id hex>/tree/        one layer, unpacked once; keyed by its content digest (the sha256 of
    layers/<diff id hex>/layer.json   the uncompressed tar, checked while unpacking); its whiteouts
    images/<image id hex>/rootfs/     the image's flat root filesystem
    images/<image id hex>/image.json  its layers and config (User, WorkingDir, Env) and refs
    index.json                        ref -> image id; task environment hash -> ref
    archives/<key>.json               archives already loaded (path, inode, size, mtime) -> their refs
    tmp/                              work in progress; emptied by the next writer

Sharing
    An image's ``rootfs`` is built from its layers' trees with hard links (``cp -al`` style): every file
    is an inode of the layer that brought it, so layers shared between images (the Debian base under
    every task image) are stored once, and a task image costs its own small layer plus one directory
    tree of links. Directories are real per image, with the mode, owner and mtime of the topmost
    layer that has them. The price of sharing: a rootfs must never be written -- runtimes mount it
    read-only, or as an overlay's lower layer -- since a write to a file writes every image's copy.

Layers are applied as overlay2 does: a path in a higher layer hides the same path below; directories
merge; ``.wh.NAME`` removes ``NAME`` of the lower layers; ``.wh..wh..opq`` empties its directory of them.

Kept: file modes (setuid included), owners (numeric uid/gid, as root; when not root, owners are left as
the caller's and a warning names the store once), symlinks, hard links, mtimes, fifos, device nodes
(where ``mknod`` is allowed: as root; else skipped), and the ``security.capability`` and ``user.*``
extended attributes (where the filesystem takes them).

Refused, with an ``ImageStoreError`` naming the archive and member: absolute member names, ``..``
components, members written through a symlink or file of the same layer, hard links to anything but an
earlier file of the same layer, layer or manifest names leaving the archive, and a layer whose content
does not match its digest. Symlink *targets* are kept as they are (absolute targets are normal in a
rootfs): the store never follows a link it unpacked, and a runtime resolves them inside the container.

Concurrency: every writer holds the store's ``flock`` (``.lock``), and results appear by atomic
``rename``, so processes loading the same archive at once are safe (the second finds the first's work
and returns in milliseconds); readers (``get``, ``refs``, ``task_ref``) take no lock.

Refs are Docker's short names: ``docker.io/library/debian:bookworm-slim`` is ``debian:bookworm-slim``,
a name without a tag gets ``:latest``; an untagged image is ``sha256:<image id>``.
"""

from __future__ import annotations

import contextlib
import fcntl
import gzip
import hashlib
import io
import json
import logging
import os
import platform
import shutil
import stat
import tarfile
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import IO, Any

from verl_agent.paths import cache_root

logger = logging.getLogger(__name__)

__all__ = ["ImageStore", "ImageStoreError", "RootfsImage", "normalize_ref", "tree_bytes"]

ENV_ROOT = "VERL_AGENT_IMAGES"
_OPAQUE = ".wh..wh..opq"
_WHITEOUT = ".wh."
_SMALL = 4 << 20  # archive members read into memory in the index pass (JSON, configs, tiny layers)
_CHUNK = 1 << 20
_IS_ROOT = os.geteuid() == 0
_XATTRS = ("security.capability", "user.")
_WARNED: set[str] = set()  # stores told, once per process, that a non-root caller keeps no owners


@dataclass(frozen=True)
class RootfsImage:
    """One image of the store: its flat root filesystem and the config a runtime needs."""

    ref: str  # e.g. "verl-agent-task:0123abcd..." (the Docker tag it was exported from)
    rootfs: Path  # a flat root filesystem directory, complete, never written by a container
    user: str  # the image config's User ("" = root)
    workdir: str  # the image config's WorkingDir ("/" if unset)
    env: dict[str, str]  # the image config's Env


class ImageStoreError(RuntimeError):
    """An archive or image cannot be stored or found; the message says what is wrong, where, and how to fix it."""


def normalize_ref(ref: str) -> str:
    """Docker's short form of an image reference: no ``docker.io/library/``, ``:latest`` when untagged."""
    for prefix in ("docker.io/library/", "index.docker.io/library/", "docker.io/", "index.docker.io/"):
        if ref.startswith(prefix):
            ref = ref[len(prefix):]
            break
    if ref.startswith("sha256:") or "@" in ref or ":" in ref.rsplit("/", 1)[-1]:
        return ref
    return f"{ref}:latest"


def tree_bytes(path: Path, seen: set[tuple[int, int]] | None = None) -> int:
    """Bytes of the files under ``path``, each inode counted once (pass ``seen`` to count across trees)."""
    seen = set() if seen is None else seen
    total = 0
    for dirpath, dirnames, filenames in os.walk(path):
        for name in filenames + dirnames:
            st = os.lstat(os.path.join(dirpath, name))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size if not stat.S_ISDIR(st.st_mode) else 0
    return total


# ---------------------------------------------------------------------------------------------------------
# Reading archives: member names, compression, and the two passes over a tar (index, then the layers).


def _safe_name(name: str, where: str) -> str:
    """A member name as a clean relative POSIX path ("" for the root); refuses absolute names and '..'."""
    if name.startswith("/"):
        raise ImageStoreError(f"{where}: member {name!r} has an absolute name: refused (path traversal)")
    parts = [p for p in PurePosixPath(name).parts if p not in ("", ".")]
    if ".." in parts:
        raise ImageStoreError(f"{where}: member {name!r} has a '..' component: refused (path traversal)")
    return "/".join(parts)


class _Prefixed(io.RawIOBase):
    """A stream whose first bytes were already read (to sniff its compression)."""

    def __init__(self, head: bytes, rest: IO[bytes]) -> None:
        self._head, self._rest = head, rest

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        if self._head:
            n = min(len(buf), len(self._head))
            buf[:n], self._head = self._head[:n], self._head[n:]
            return n
        data = self._rest.read(len(buf))
        buf[: len(data)] = data
        return len(data)


def _decompressed(raw: IO[bytes]) -> IO[bytes]:
    """``raw``, or a reader of its content when it is gzip or zstd (by magic number)."""
    head = raw.read(4)
    stream = io.BufferedReader(_Prefixed(head, raw), _CHUNK)
    if head[:2] == b"\x1f\x8b":
        return gzip.GzipFile(fileobj=stream)  # type: ignore[return-value]
    if head == b"\x28\xb5\x2f\xfd":
        import zstandard  # a dependency of the project (the checkpoint codec); imported only where needed

        return zstandard.ZstdDecompressor().stream_reader(stream, read_across_frames=True)  # type: ignore
    return stream


class _Hashing(io.RawIOBase):
    """Passes a stream through, hashing what is read (the diff id of an uncompressed layer)."""

    def __init__(self, inner: IO[bytes]) -> None:
        self._inner, self.sha = inner, hashlib.sha256()

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        data = self._inner.read(len(buf))
        self.sha.update(data)
        buf[: len(data)] = data
        return len(data)

    def drain(self) -> str:
        """Read what tarfile left (its end-of-archive padding) and return ``sha256:<hex>``."""
        while self.read(_CHUNK):
            pass
        return f"sha256:{self.sha.hexdigest()}"


class _Source:
    """The members of an archive: a tar (plain or compressed) or a directory."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.small: dict[str, bytes] = {}  # tar: members up to _SMALL bytes, read in the index pass
        self.links: dict[str, str] = {}  # tar: symlink/hardlink member -> the member it names
        self.names: set[str] = set()
        if not path.is_dir():
            self._index_tar()

    def _open_tar(self) -> tuple[IO[bytes], tarfile.TarFile]:
        raw = open(self.path, "rb")  # noqa: SIM115 -- closed by the caller
        stream = _decompressed(raw)
        return raw, tarfile.open(fileobj=stream, mode="r|")

    def _index_tar(self) -> None:
        raw, tar = self._open_tar()
        try:
            for m in tar:
                name = _safe_name(m.name, str(self.path))
                self.names.add(name)
                if m.issym() or m.islnk():
                    base = "" if m.islnk() else str(PurePosixPath(name).parent)
                    self.links[name] = _safe_name(os.path.normpath(os.path.join(base, m.linkname))
                                                  if base else m.linkname, f"{self.path}: link {name!r}")
                elif m.isreg() and m.size <= _SMALL:
                    f = tar.extractfile(m)
                    self.small[name] = f.read() if f else b""
        except _corrupt() as e:
            raise ImageStoreError(f"{self.path}: not a readable tar archive ({type(e).__name__}: {e}); expected "
                                  "a `docker save` tar or an OCI image layout, plain, .gz or .zst") from e
        finally:
            tar.close()
            raw.close()

    def _resolve(self, name: str) -> str:
        for _ in range(16):
            if name not in self.links:
                return name
            name = self.links[name]
        raise ImageStoreError(f"{self.path}: member {name!r}: too many levels of links")

    def has(self, name: str) -> bool:
        if self.path.is_dir():
            return (self.path / name).is_file()
        return self._resolve(name) in self.names

    def read(self, name: str) -> bytes:
        """A small member (manifest, index, config)."""
        name = _safe_name(name, str(self.path))
        if self.path.is_dir():
            return self._dir_file(name).read_bytes()
        real = self._resolve(name)
        if real not in self.small:
            raise ImageStoreError(f"{self.path}: member {name!r} is missing or too large for a JSON document")
        return self.small[real]

    def _dir_file(self, name: str) -> Path:
        path = (self.path / name).resolve()
        if not path.is_relative_to(self.path.resolve()):
            raise ImageStoreError(f"{self.path}: {name!r} leads outside the layout: refused (path traversal)")
        if not path.is_file():
            raise ImageStoreError(f"{self.path}: {name!r} is missing")
        return path

    def members(self, wanted: set[str]) -> Iterator[tuple[str, IO[bytes]]]:
        """(name, reader) for each wanted member: from memory, the directory, or one more pass over the tar."""
        todo: dict[str, str] = {}
        for name in wanted:
            real = name if self.path.is_dir() else self._resolve(_safe_name(name, str(self.path)))
            if self.path.is_dir():
                with open(self._dir_file(name), "rb") as f:
                    yield name, f
            elif real in self.small:
                yield name, io.BytesIO(self.small[real])
            else:
                todo[real] = name
        if todo:
            yield from self._stream(todo)

    def _stream(self, todo: dict[str, str]) -> Iterator[tuple[str, IO[bytes]]]:
        raw, tar = self._open_tar()
        try:
            for m in tar:
                name = _safe_name(m.name, str(self.path))
                if name in todo and m.isreg():
                    yield todo.pop(name), tar.extractfile(m)  # type: ignore[misc]
                    if not todo:
                        return
        finally:
            tar.close()
            raw.close()
        if todo:
            raise ImageStoreError(f"{self.path}: members {sorted(todo)} named by the manifest are not in it")


# ---------------------------------------------------------------------------------------------------------
# Manifests: which images an archive holds, their configs and the members holding their layers.


@dataclass(frozen=True)
class _Entry:
    refs: list[str]
    config: bytes
    layers: list[str]  # archive members, bottom layer first


def _json(src: _Source, name: str, where: str) -> Any:
    try:
        return json.loads(src.read(name))
    except ValueError as e:
        raise ImageStoreError(f"{where}: {name} is not valid JSON ({e})") from None


def _blob(digest: Any, where: str) -> str:
    """The member holding an OCI blob; refuses anything but ``sha256:<64 hex>`` (no path games)."""
    alg, _, hexd = str(digest).partition(":")
    if alg != "sha256" or len(hexd) != 64 or any(c not in "0123456789abcdef" for c in hexd):
        raise ImageStoreError(f"{where}: digest {digest!r} is not of the form sha256:<64 lowercase hex digits>")
    return f"blobs/sha256/{hexd}"


def _entries(src: _Source, where: str) -> list[_Entry]:
    if src.has("manifest.json"):  # docker save (Docker >= 25 writes an OCI layout beside it; this one is simpler)
        return _docker_entries(src, where)
    if src.has("index.json"):
        return _oci_entries(src, where)
    raise ImageStoreError(f"{where}: neither manifest.json (`docker save`) nor index.json (OCI image layout) at "
                          "its top: not an image archive")


def _docker_entries(src: _Source, where: str) -> list[_Entry]:
    manifest = _json(src, "manifest.json", where)
    if not isinstance(manifest, list):
        raise ImageStoreError(f"{where}: manifest.json is not a list of images")
    out = []
    for i, item in enumerate(manifest):
        try:
            config, layers, tags = item["Config"], [str(x) for x in item["Layers"]], item.get("RepoTags") or []
        except (KeyError, TypeError) as e:
            raise ImageStoreError(f"{where}: manifest.json entry {i} lacks Config or Layers ({e!r})") from None
        out.append(_Entry([normalize_ref(t) for t in tags], src.read(config), layers))
    return out


def _oci_entries(src: _Source, where: str) -> list[_Entry]:
    index = _json(src, "index.json", where)
    out = []
    for desc in index.get("manifests") or []:
        notes = desc.get("annotations") or {}
        name = notes.get("io.containerd.image.name") or notes.get("org.opencontainers.image.ref.name")
        refs = [normalize_ref(name) if ("/" in name or ":" in name) else name] if name else []
        manifest = _oci_manifest(src, desc, where, 0)
        digest = manifest["config"]["digest"]
        config = src.read(_blob(digest, where))
        if f"sha256:{hashlib.sha256(config).hexdigest()}" != digest:
            raise ImageStoreError(f"{where}: config blob {digest} does not match its digest: the layout is corrupt")
        out.append(_Entry(refs, config, [_blob(x["digest"], where) for x in manifest.get("layers") or []]))
    return out


def _oci_manifest(src: _Source, desc: dict, where: str, depth: int) -> dict:
    """The image manifest a descriptor leads to; through an image index, the one for this machine."""
    doc = _json(src, _blob(desc.get("digest"), where), where)
    if "manifests" not in doc:
        return doc
    arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
    fits = [m for m in doc["manifests"] if (m.get("platform") or {}).get("os", "linux") == "linux"
            and (m.get("platform") or {}).get("architecture", arch) == arch]
    if not fits or depth > 4:
        raise ImageStoreError(f"{where}: image index {desc.get('digest')} holds no linux/{arch} image")
    return _oci_manifest(src, fits[0], where, depth + 1)


def _diff_ids(config: dict, layers: int, where: str) -> list[str]:
    ids = (config.get("rootfs") or {}).get("diff_ids")
    if not isinstance(ids, list) or len(ids) != layers:
        raise ImageStoreError(f"{where}: the image config lists {len(ids) if isinstance(ids, list) else 'no'} "
                              f"diff ids for {layers} layers")
    for d in ids:
        _blob(d, where)
    return [str(d) for d in ids]


# ---------------------------------------------------------------------------------------------------------
# Unpacking one layer into its own tree (whiteouts recorded, not applied: they act on the layers below).


def _set_meta(path: str, m: tarfile.TarInfo, is_link: bool) -> None:
    if _IS_ROOT:
        os.lchown(path, m.uid, m.gid)
    if not is_link:
        os.chmod(path, m.mode & 0o7777)  # after chown, which clears setuid bits
    ns = int(m.mtime * 1_000_000_000)
    os.utime(path, ns=(ns, ns), follow_symlinks=False)
    for key, value in (m.pax_headers or {}).items():
        name = key.removeprefix("SCHILY.xattr.")
        if name != key and name.startswith(_XATTRS):
            with contextlib.suppress(OSError):  # not every filesystem or user may set them
                os.setxattr(path, name, value.encode("utf-8", "surrogateescape"), follow_symlinks=False)


class _Unpack:
    """State of one layer being unpacked: what each path of the tree is, so no write goes through a link."""

    def __init__(self, tree: Path, where: str) -> None:
        self.tree, self.where = str(tree), where
        self.kinds: dict[str, str] = {"": "d"}  # "d" directory, "l" symlink, "f" anything else
        self.dirs: dict[str, tarfile.TarInfo] = {}  # explicit directories: metadata set once children are in
        self.implicit: set[str] = {""}  # directories the layer implies but does not list
        self.whiteouts: list[str] = []
        self.opaque: list[str] = []
        self.skipped = 0
        os.mkdir(self.tree, 0o755)

    def _parents(self, parent: str, name: str) -> None:
        if self.kinds.get(parent) == "d":
            return
        prefix = ""
        for part in parent.split("/"):
            prefix = f"{prefix}/{part}" if prefix else part
            kind = self.kinds.get(prefix)
            if kind is None:
                os.mkdir(os.path.join(self.tree, prefix), 0o755)
                self.kinds[prefix] = "d"
                self.implicit.add(prefix)
            elif kind != "d":
                what = "symlink" if kind == "l" else "file"
                raise ImageStoreError(f"{self.where}: member {name!r} goes through {prefix!r}, a {what} of the "
                                      "same layer: refused (path traversal)")

    def _clear(self, rel: str, is_dir: bool) -> None:
        """Make room for a member whose path an earlier member of this layer took (the later one wins)."""
        kind = self.kinds.get(rel)
        if kind is None or (kind == "d" and is_dir):
            return
        path = os.path.join(self.tree, rel)
        if kind == "d":
            _rmtree(path)
            for k in [k for k in self.kinds if k.startswith(rel + "/")]:
                del self.kinds[k]
        else:
            os.unlink(path)
        del self.kinds[rel]

    def member(self, tar: tarfile.TarFile, m: tarfile.TarInfo) -> None:
        rel = _safe_name(m.name, self.where)
        parent, _, base = rel.rpartition("/")
        if base.startswith(_WHITEOUT):
            self._parents(parent, m.name)
            if base == _OPAQUE:
                self.opaque.append(parent)
            elif not base.startswith(_WHITEOUT + _WHITEOUT):  # other .wh..wh.* are aufs bookkeeping
                self.whiteouts.append(f"{parent}/{base[4:]}" if parent else base[4:])
            return
        if rel == "":
            if m.isdir():
                self.dirs[""] = m
                self.implicit.discard("")
            return
        self._parents(parent, m.name)
        self._clear(rel, m.isdir())
        self._create(tar, m, rel, os.path.join(self.tree, rel))

    def _create(self, tar: tarfile.TarFile, m: tarfile.TarInfo, rel: str, path: str) -> None:
        if m.isdir():
            if rel not in self.kinds:
                os.mkdir(path, 0o700)  # its own mode once its children are in (it may forbid writing)
            self.kinds[rel] = "d"
            self.dirs[rel] = m
            self.implicit.discard(rel)
            return
        if m.islnk():
            target = _safe_name(m.linkname, f"{self.where}: hard link {m.name!r}")
            if self.kinds.get(target) not in ("f", "l"):
                raise ImageStoreError(f"{self.where}: hard link {m.name!r} -> {m.linkname!r} does not name an "
                                      "earlier file of the same layer: refused")
            os.link(os.path.join(self.tree, target), path, follow_symlinks=False)
            self.kinds[rel] = self.kinds[target]
            return  # one inode: its metadata is the target's
        if not self._make(tar, m, path):
            return
        self.kinds[rel] = "l" if m.issym() else "f"
        _set_meta(path, m, m.issym())

    def _make(self, tar: tarfile.TarFile, m: tarfile.TarInfo, path: str) -> bool:
        if m.isreg():
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            with os.fdopen(fd, "wb") as out:
                src = tar.extractfile(m)
                if src is not None:
                    shutil.copyfileobj(src, out, _CHUNK)
        elif m.issym():
            os.symlink(m.linkname, path)
        elif m.isfifo():
            os.mkfifo(path, 0o600)
        elif m.ischr() or m.isblk():
            kind = stat.S_IFCHR if m.ischr() else stat.S_IFBLK
            try:
                os.mknod(path, kind | 0o600, os.makedev(m.devmajor, m.devminor))
            except PermissionError:  # not root: the node is left out (runtimes mount their own /dev)
                self.skipped += 1
                return False
        else:
            self.skipped += 1  # nothing else is a filesystem object
            return False
        return True

    def finish(self) -> dict:
        for rel in sorted(self.dirs, reverse=True):  # children before their parents
            _set_meta(os.path.join(self.tree, rel) if rel else self.tree, self.dirs[rel], False)
        return {"whiteouts": self.whiteouts, "opaque": self.opaque, "implicit": sorted(self.implicit),
                "skipped": self.skipped, "entries": len(self.kinds)}


def _unpack(fileobj: IO[bytes], tree: Path, where: str) -> dict:
    state = _Unpack(tree, where)
    try:
        with tarfile.open(fileobj=fileobj, mode="r|") as tar:
            for m in tar:
                state.member(tar, m)
    except _corrupt() as e:
        raise ImageStoreError(f"{where}: not a readable layer tar ({type(e).__name__}: {e})") from e
    return state.finish()


def _corrupt() -> tuple[type[Exception], ...]:
    """What a truncated or damaged (compressed) tar raises while being read."""
    errors: list[type[Exception]] = [tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile]
    with contextlib.suppress(ImportError):
        import zstandard

        errors.append(zstandard.ZstdError)
    return tuple(errors)


# ---------------------------------------------------------------------------------------------------------
# Composing an image's rootfs from its layer trees with hard links.


def _rmtree(path: str | Path) -> None:
    """Remove a tree, also one holding directories we may not write to (a non-root store)."""

    def fix(func: Callable, p: str, _exc: Any) -> None:
        with contextlib.suppress(OSError):
            os.chmod(os.path.dirname(p), 0o700)
            os.chmod(p, 0o700) if os.path.isdir(p) and not os.path.islink(p) else None
        func(p)

    shutil.rmtree(path, onerror=fix)


def _remove(path: str) -> None:
    if stat.S_ISDIR(os.lstat(path).st_mode):
        _rmtree(path)
    else:
        os.unlink(path)


def _lower(rootfs: str, rel: str) -> str | None:
    """The path of ``rel`` in the rootfs being composed when it exists there with real directories above
    it (a whiteout under a symlinked directory hides nothing: the lower path is not a directory)."""
    path = rootfs
    parts = rel.split("/")
    for i, part in enumerate(parts):
        path = os.path.join(path, part)
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            return None
        if i < len(parts) - 1 and not stat.S_ISDIR(mode):
            return None
    return path


def _link(src: str, dst: str) -> None:
    try:
        os.link(src, dst, follow_symlinks=False)
    except FileExistsError:
        _remove(dst)
        os.link(src, dst, follow_symlinks=False)
    except OSError as e:
        if e.errno != 31:  # EMLINK: the inode has the filesystem's most links; this image gets a copy
            raise
        shutil.copy2(src, dst, follow_symlinks=False)
        st = os.lstat(src)
        if _IS_ROOT:
            os.lchown(dst, st.st_uid, st.st_gid)


def _merge(src: str, dst: str, rel: str, dirs: dict[str, str], implicit: set[str]) -> None:
    """Link the layer tree ``src`` into ``dst``: its non-directories hide what is there, directories merge."""
    with os.scandir(src) as it:
        entries = list(it)
    for e in entries:
        target = os.path.join(dst, e.name)
        r = f"{rel}/{e.name}" if rel else e.name
        if e.is_dir(follow_symlinks=False):
            try:
                os.mkdir(target, 0o700)
            except FileExistsError:
                if not stat.S_ISDIR(os.lstat(target).st_mode):
                    os.unlink(target)
                    os.mkdir(target, 0o700)
            if r not in implicit or r not in dirs:  # a directory the layer only implies keeps the lower one's
                dirs[r] = e.path
            _merge(e.path, target, r, dirs, implicit)
        else:
            _link(e.path, target)


def _copy_dir_meta(src: str, dst: str) -> None:
    st, cur = os.lstat(src), os.lstat(dst)
    if not stat.S_ISDIR(cur.st_mode):
        return
    if _IS_ROOT and (cur.st_uid, cur.st_gid) != (st.st_uid, st.st_gid):
        os.lchown(dst, st.st_uid, st.st_gid)
    os.chmod(dst, stat.S_IMODE(st.st_mode))
    os.utime(dst, ns=(st.st_mtime_ns, st.st_mtime_ns), follow_symlinks=False)


def _forget(dirs: dict[str, str], prefix: str) -> None:
    for k in [k for k in dirs if k.startswith(prefix) and k]:
        del dirs[k]


def _compose(layers: list[Path], rootfs: Path) -> None:
    """Apply the layers bottom-up into the new directory ``rootfs``, as overlay2 would stack them."""
    os.mkdir(rootfs, 0o755)
    root = str(rootfs)
    dirs: dict[str, str] = {}
    for layer in layers:
        meta = json.loads((layer / "layer.json").read_text())
        for rel in meta["opaque"]:
            target = _lower(root, rel) if rel else root
            if target and stat.S_ISDIR(os.lstat(target).st_mode):
                for child in os.listdir(target):
                    _remove(os.path.join(target, child))
                _forget(dirs, f"{rel}/" if rel else "")
        for rel in meta["whiteouts"]:
            target = _lower(root, rel)
            if target:
                _remove(target)
                dirs.pop(rel, None)
                _forget(dirs, f"{rel}/")
        tree = str(layer / "tree")
        implicit = set(meta["implicit"])
        if "" not in implicit or "" not in dirs:
            dirs[""] = tree
        _merge(tree, root, "", dirs, implicit)
    for rel in sorted(dirs, reverse=True):
        target = _lower(root, rel) if rel else root
        if target:
            _copy_dir_meta(dirs[rel], target)


# ---------------------------------------------------------------------------------------------------------
# The store.


def _hex(digest: str) -> str:
    return digest.partition(":")[2]


def _write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` so readers see the old file or the new one, never a part (rename is atomic)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1, sort_keys=True))
    os.replace(tmp, path)


def _env(items: Any) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items or []:
        key, _, value = str(item).partition("=")
        out[key] = value
    return out


class ImageStore:
    """Images as flat root filesystems on local disk; see the module's docstring for the layout."""

    def __init__(self, root: Path | None = None) -> None:
        default = os.environ.get(ENV_ROOT) or cache_root() / "images"
        self.root = Path(root if root is not None else default).expanduser().absolute()
        self._index_seen: tuple[tuple[int, int, int], dict] | None = None
        if not _IS_ROOT and str(self.root) not in _WARNED:
            _WARNED.add(str(self.root))
            logger.warning("image store %s: not running as root, so file owners are not kept (every file is "
                           "the caller's) and device nodes are skipped; modes are kept", self.root)

    # -- reading (no lock: everything below appears by rename) -------------------------------------------

    def _index(self) -> dict:
        path = self.root / "index.json"
        try:
            st = path.stat()
        except FileNotFoundError:
            return {"refs": {}, "tasks": {}}
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        if self._index_seen is None or self._index_seen[0] != key:
            self._index_seen = (key, json.loads(path.read_text()))
        return self._index_seen[1]

    def get(self, ref: str) -> RootfsImage | None:
        """The image under ``ref`` (a name, or ``sha256:<image id>``), or None when the store lacks it."""
        ref = normalize_ref(ref)
        image_id = ref if ref.startswith("sha256:") else self._index()["refs"].get(ref)
        if not image_id:
            return None
        folder = self.root / "images" / _hex(image_id)
        try:
            record = json.loads((folder / "image.json").read_text())
        except FileNotFoundError:
            return None
        return RootfsImage(ref=ref, rootfs=folder / "rootfs", user=record["user"], workdir=record["workdir"],
                           env=dict(record["env"]))

    def refs(self) -> list[str]:
        return sorted(self._index()["refs"])

    def task_ref(self, env_hash: str) -> str | None:
        """The ref of the image built for a task's environment/ (``environment_hash``), if recorded."""
        return self._index()["tasks"].get(env_hash)

    def set_task_ref(self, env_hash: str, ref: str) -> None:
        with self._locked():
            self._update_index(tasks={env_hash: normalize_ref(ref)})

    # -- writing (under the store's lock) -----------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The store's writer lock (flock: across processes and threads); clears what dead writers left."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".lock", "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                tmp = self.root / "tmp"
                if tmp.is_dir():
                    for child in tmp.iterdir():
                        _rmtree(child)
                for sub in ("tmp", "layers", "images", "archives"):
                    (self.root / sub).mkdir(exist_ok=True)
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _update_index(self, refs: dict[str, str] | None = None, tasks: dict[str, str] | None = None) -> None:
        path = self.root / "index.json"
        index = json.loads(path.read_text()) if path.exists() else {"refs": {}, "tasks": {}}
        index["refs"].update(refs or {})
        index["tasks"].update(tasks or {})
        _write_json(path, index)

    def _tmpdir(self, prefix: str) -> Path:
        import tempfile

        return Path(tempfile.mkdtemp(prefix=prefix, dir=self.root / "tmp"))

    def load_archive(self, archive: Path) -> list[str]:
        """Load every image of a ``docker save`` tar or OCI image layout (tar or directory; plain, .gz or
        .zst) and return their refs. A second call for the same file returns at once."""
        archive = Path(archive).absolute()
        if not archive.exists():
            raise ImageStoreError(f"{archive}: no such file or directory (an image archive: `docker save` tar "
                                  "or OCI image layout)")
        key = self._archive_key(archive)
        refs = self._loaded(key)
        if refs is not None:
            return refs
        with self._locked():
            refs = self._loaded(key)  # another process may have loaded it while we waited
            if refs is None:
                refs = self._load(_Source(archive), str(archive))
                _write_json(self.root / "archives" / f"{key}.json", {"archive": str(archive), "refs": refs})
        return refs

    def _archive_key(self, archive: Path) -> str:
        probe = archive
        if archive.is_dir():
            probe = next((archive / n for n in ("manifest.json", "index.json") if (archive / n).is_file()), archive)
        st = probe.stat()
        ident = f"{archive.resolve()}\0{st.st_dev}\0{st.st_ino}\0{st.st_size}\0{st.st_mtime_ns}"
        return hashlib.sha256(ident.encode()).hexdigest()[:32]

    def _loaded(self, key: str) -> list[str] | None:
        try:
            refs = json.loads((self.root / "archives" / f"{key}.json").read_text())["refs"]
        except (FileNotFoundError, ValueError, KeyError):
            return None
        return refs if all(self.get(r) is not None for r in refs) else None

    def _load(self, src: _Source, where: str) -> list[str]:
        plan: list[tuple[_Entry, str, dict, list[str]]] = []
        needed: dict[str, str] = {}  # archive member -> the diff id it must have
        for entry in _entries(src, where):
            image_id = f"sha256:{hashlib.sha256(entry.config).hexdigest()}"
            try:
                config = json.loads(entry.config)
            except ValueError as e:
                raise ImageStoreError(f"{where}: the config of image {image_id} is not JSON ({e})") from None
            diff_ids = _diff_ids(config, len(entry.layers), f"{where}: image {image_id}")
            if not (self.root / "images" / _hex(image_id)).is_dir():
                needed.update({m: d for m, d in zip(entry.layers, diff_ids)
                               if not (self.root / "layers" / _hex(d)).is_dir()})
            plan.append((entry, image_id, config, diff_ids))
        for member, reader in src.members(set(needed)):
            if not (self.root / "layers" / _hex(needed[member])).is_dir():  # one layer, two member names
                self._store_layer(reader, needed[member], f"{where}: layer {member}")
        refs: dict[str, str] = {}
        for entry, image_id, config, diff_ids in plan:
            if not (self.root / "images" / _hex(image_id)).is_dir():
                self._build_image(image_id, config, diff_ids)
            refs.update({r: image_id for r in entry.refs or [image_id]})
        self._update_index(refs={r: i for r, i in refs.items() if not r.startswith("sha256:")})
        return list(refs)

    def _store_layer(self, reader: IO[bytes], diff_id: str, where: str) -> None:
        t0 = time.perf_counter()
        work = self._tmpdir("layer-")
        hashing = _Hashing(_decompressed(reader))
        meta = _unpack(hashing, work / "tree", where)
        got = hashing.drain()
        if got != diff_id:
            raise ImageStoreError(f"{where}: its content has digest {got}, but the image config says {diff_id}: "
                                  "the archive is damaged or was altered; export it again")
        _write_json(work / "layer.json", {"diff_id": diff_id, **meta})
        os.rename(work, self.root / "layers" / _hex(diff_id))
        logger.debug("%s: unpacked %d entries in %.2f s", where, meta["entries"], time.perf_counter() - t0)

    def _build_image(self, image_id: str, config: dict, diff_ids: list[str]) -> None:
        work = self._tmpdir("image-")
        _compose([self.root / "layers" / _hex(d) for d in diff_ids], work / "rootfs")
        conf = config.get("config") or {}
        record = {"id": image_id, "layers": diff_ids, "user": conf.get("User") or "",
                  "workdir": conf.get("WorkingDir") or "/", "env": _env(conf.get("Env")), "config": conf}
        _write_json(work / "image.json", record)
        os.rename(work, self.root / "images" / _hex(image_id))

    def from_docker(self, client: Any, image: str) -> RootfsImage:
        """Export the local Docker image ``image`` into the store (``docker save`` through the SDK) and return
        it; an image already stored (same id) only gets the ref."""
        try:
            found = client.images.get(image)
        except Exception as e:  # docker.errors.ImageNotFound / APIError: the SDK stays an optional import here
            raise ImageStoreError(f"{image}: not a local Docker image ({type(e).__name__}: {e}); build it or "
                                  "`docker load` it first") from e
        ref = normalize_ref(image) if not image.startswith("sha256:") else found.id
        with self._locked():
            if not (self.root / "images" / _hex(found.id)).is_dir():
                tar = self._tmpdir("docker-save-") / "image.tar"
                with open(tar, "wb") as f:
                    for chunk in found.save(named=image if image in found.tags else False):
                        f.write(chunk)
                self._load(_Source(tar), f"docker image {image} (saved to {tar})")
            if not ref.startswith("sha256:"):
                self._update_index(refs={ref: found.id})
        got = self.get(ref)
        if got is None:
            raise ImageStoreError(f"{image}: `docker save` gave no image {found.id}; is the daemon's image store "
                                  f"consistent? (`docker image inspect {image}`)")
        return got
