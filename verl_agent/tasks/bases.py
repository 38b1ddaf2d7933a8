"""Offline stand-ins for the base images Harbor tasks start ``FROM``: ``debian:bookworm-slim``, ``python:3.12-slim``.

No registry is reachable on our machines, so these cannot be pulled. ``debian:bookworm-slim`` is derived from
the sandbox's offline base image (``verl_agent.sandbox.image``: Debian bookworm debootstrapped from the apt
mirror with python3, g++ and nodejs), so one debootstrap serves the sandbox and both bases.
``python:3.12-slim`` is built ``FROM`` the debian stand-in, as the real one is ``FROM debian:bookworm-slim``:
the two share their lower layer, so a ``docker save`` of both (``verl-agent tasks export``) carries Debian once.

Both are slimmed the way Debian's official ``-slim`` images are (debuerreotype's ``slimify`` and
``minimizing-config``): no documentation, man or info pages, no translations (``/usr/share/locale``, except
``locale.alias``), no lintian overrides, no apt lists or package caches, no logs; and dpkg/apt are configured
(``/etc/dpkg/dpkg.cfg.d/docker``, ``/etc/apt/apt.conf.d/docker-*``) so that packages a task installs later
stay slim too.

``debian:bookworm-slim``
    Every package that is neither Debian-required nor apt is purged; what stays (bash, coreutils, grep,
    sed, findutils, tar, gzip, apt, ...) is about what the real image holds. The purged container is
    flattened to ONE layer (``docker export`` | ``docker import``, its config -- ``CMD ["bash"]``, ``ENV PATH``,
    labels -- restored through ``--change``), so the big sandbox layer it came from is not part of it.
    No device nodes in ``/dev`` and no ``sandbox`` user, as in the real image. root, ``WORKDIR /``.
``python:3.12-slim``
    One layer on top of the debian stand-in: Debian bookworm's own ``python3``, which is **Python 3.11**
    (bookworm has no 3.12 package and nothing can be downloaded from python.org here), with ``pip``, ``venv``
    and the ``python`` command, installed with one ``apt-get install`` from the mirror; pip installs
    system-wide as in the real image (Debian's PEP 668 marker is removed). The standard library's byte-code
    is kept (14 MB): without it every ``python3`` start as a non-root user, who cannot write it, compiles
    again (``import json, subprocess, pathlib``: 110 ms instead of 35 ms, measured); pip's and setuptools'
    (13 MB) is dropped: they run rarely in a task. The image says what it is: label
    ``org.verl-agent.python=3.11`` and ``org.verl-agent.stand-in-for=python:3.12-slim``. A task that needs
    3.12-only features fails here and needs a real image (``docker load`` it under that tag).

A public tag is given only where no such image exists locally: a real (or any foreign) image under that
name is never replaced. One of ours built from an older recipe (its ``org.verl-agent.base-recipe`` label
differs, or the image it starts from changed) is rebuilt; one from this recipe is kept, so a second call
only inspects the images.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from verl_agent.sandbox import image as sandbox_image

__all__ = ["BASES", "Base", "ensure_bases", "main"]

RECIPE_LABEL = "org.verl-agent.base-recipe"
RECIPE_VERSION = "2"  # bump to rebuild every stand-in built from an older recipe

# debuerreotype's .slimify-excludes / .slimify-includes, as dpkg path filters (kept for later installs).
_DPKG_SLIM = """\
# Slim image (as Debian's -slim images): no docs, man/info pages, translations or lintian overrides.
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/groff/*
path-exclude /usr/share/info/*
path-exclude /usr/share/linda/*
path-exclude /usr/share/lintian/overrides/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
path-exclude /usr/share/man/*
"""
# debuerreotype's minimizing-config: apt cleans after itself and fetches no translations.
_APT_RM = '"rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true";'
_APT_CLEAN = (f"DPkg::Post-Invoke {{ {_APT_RM} }};\nAPT::Update::Post-Invoke {{ {_APT_RM} }};\n"
              'Dir::Cache::pkgcache "";\nDir::Cache::srcpkgcache "";\n')
_APT_FILES = {
    "docker-clean": _APT_CLEAN,
    "docker-no-languages": 'Acquire::Languages "none";\n',
    "docker-gzip-indexes": 'Acquire::GzipIndexes "true";\n',
    "docker-autoremove-suggests": 'Apt::AutoRemove::SuggestsImportant "false";\n',
}

# What the dpkg filters would have kept out, removed from what is already installed; then caches and logs.
_SLIMIFY = (
    "find /usr/share/doc -mindepth 1 ! -type d ! -name copyright -delete"
    " && find /usr/share/doc -mindepth 1 -type d -empty -delete"
    " && rm -rf /usr/share/groff/* /usr/share/info/* /usr/share/linda/* /usr/share/lintian/overrides/*"
    " /usr/share/man/*"
    " && find /usr/share/locale -mindepth 1 -maxdepth 1 ! -name locale.alias -exec rm -rf {} +"
    " && apt-get clean && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/cache/debconf/*-old"
    " /var/log/apt /var/log/dpkg.log /var/log/alternatives.log /var/log/bootstrap.log /tmp/* /var/tmp/*"
)

# Mark every package auto-installed except `keep`, then let apt remove what nothing manual needs.
# Works offline: the sandbox base has no apt lists, and autoremove reads only dpkg's status.
_PURGE = (
    "mkdir -p /var/lib/apt/lists/partial"
    " && apt-mark auto $(dpkg-query -W -f '${Package}\\n') >/dev/null"
    " && apt-mark manual apt >/dev/null"
    " && apt-mark manual $(dpkg-query -W -f '${Package} ${Priority}\\n'"
    " | awk '$2==\"required\"{print $1}') >/dev/null"
    " && DEBIAN_FRONTEND=noninteractive apt-get -y -q autoremove --purge >/dev/null"
)

_DEBIAN = f"""\
ARG BASE_IMAGE
FROM ${{BASE_IMAGE}}
USER root
COPY docker-slim /etc/dpkg/dpkg.cfg.d/docker
COPY apt/ /etc/apt/apt.conf.d/
RUN {_PURGE} \\
 && sed -i '/^sandbox:/d' /etc/passwd /etc/group \\
 && {_SLIMIFY}
"""
# the flat image's config (docker import --change); the build above only prepares its files
_DEBIAN_CONFIG = ["ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "WORKDIR /",
                  'CMD ["bash"]',
                  'LABEL org.verl-agent.stand-in-for="debian:bookworm-slim" org.verl-agent.debian="bookworm"']

_PYTHON = f"""\
ARG BASE_IMAGE
FROM ${{BASE_IMAGE}}
USER root
RUN apt-get -q update >/dev/null \\
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \\
      python3 python3-pip python3-venv python-is-python3 ca-certificates >/dev/null \\
 && rm -f /usr/lib/python3*/EXTERNALLY-MANAGED \\
 && find /usr/lib/python3/dist-packages -depth -type d -name __pycache__ -exec rm -rf {{}} + \\
 && {_SLIMIFY}
LABEL org.verl-agent.stand-in-for="python:3.12-slim" org.verl-agent.python="3.11" \\
      org.verl-agent.debian="bookworm"
ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 PYTHONUNBUFFERED=1
WORKDIR /
CMD ["python3"]
"""


@dataclass(frozen=True)
class Base:
    """One stand-in: the public tag it takes, the Dockerfile that derives it from ``parent`` (an image), the
    extra files of its build context, and, for a flat image, the config ``docker import`` gives it."""

    tag: str
    dockerfile: str
    parent: str = sandbox_image.BASE_IMAGE
    files: dict[str, str] = field(default_factory=dict)
    flat_config: tuple[str, ...] = ()

    def recipe(self, parent_id: str) -> str:
        """A hash of the recipe and of the image it starts from: it changes when either does."""
        text = "\0".join([RECIPE_VERSION, self.dockerfile, *sorted(f"{k}\0{v}" for k, v in self.files.items()),
                          *self.flat_config, parent_id])
        return hashlib.sha256(text.encode()).hexdigest()[:16]


_DEBIAN_FILES = {"docker-slim": _DPKG_SLIM, **{f"apt/{name}": text for name, text in _APT_FILES.items()}}
BASES = (Base("debian:bookworm-slim", _DEBIAN, files=_DEBIAN_FILES, flat_config=tuple(_DEBIAN_CONFIG)),
         Base("python:3.12-slim", _PYTHON, parent="debian:bookworm-slim"))


def _label(tag: str) -> str | None:
    """Our recipe label on a local image; "" for an image that is not ours; None when there is no image."""
    out = subprocess.run(["docker", "image", "inspect", "-f", f'{{{{index .Config.Labels "{RECIPE_LABEL}"}}}}', tag],
                         capture_output=True, text=True)
    if out.returncode != 0:
        return None
    value = out.stdout.strip()
    return "" if value in ("", "<no value>") else value


def _docker(argv: list[str], what: str, **kwargs) -> str:
    out = subprocess.run(["docker", *argv], capture_output=True, text=True, **kwargs)
    if out.returncode != 0:
        raise RuntimeError(f"{what}: `docker {' '.join(argv[:3])} ...` failed: {out.stderr.strip()[-2000:]}")
    return out.stdout.strip()


def _build(base: Base, recipe: str) -> None:
    """docker build the recipe; a flat base is then exported and imported as one layer."""
    label = f'LABEL {RECIPE_LABEL}="{recipe}"'
    target = f"{base.tag.replace(':', '-')}-build:{recipe}" if base.flat_config else base.tag
    with tempfile.TemporaryDirectory(prefix="verl-task-base-") as ctx:
        (Path(ctx) / "Dockerfile").write_text(base.dockerfile + ("" if base.flat_config else label + "\n"))
        for name, text in base.files.items():
            (Path(ctx) / name).parent.mkdir(parents=True, exist_ok=True)
            (Path(ctx) / name).write_text(text)
        _docker(["build", "-q", "--build-arg", f"BASE_IMAGE={base.parent}", "-t", target, ctx],
                f"building the offline stand-in for {base.tag} (python:3.12-slim needs the Debian mirror)",
                env=sandbox_image._legacy_builder_env())
    if base.flat_config:
        try:
            _flatten(target, base.tag, [*base.flat_config, label])
        finally:
            subprocess.run(["docker", "image", "rm", target], capture_output=True)


# Files `docker export` adds that belong to the container, not to the image: Docker's marker, the console,
# and the empty mount points of /etc/hostname, hosts and resolv.conf (Docker provides them at run time).
_CONTAINER_ONLY = {".dockerenv", "etc/hostname", "etc/hosts", "etc/resolv.conf"}


def _copy_image_files(src: IO[bytes], dst: IO[bytes]) -> None:
    """Copy an exported container's tar, leaving out the container's own files and every node under /dev
    (the real slim image ships an empty /dev; runtimes mount their own)."""
    with (tarfile.open(fileobj=src, mode="r|") as tin,
          tarfile.open(fileobj=dst, mode="w|", format=tarfile.PAX_FORMAT) as tout):
        for member in tin:
            name = member.name.removeprefix("./")
            if name in _CONTAINER_ONLY or name.startswith("dev/"):
                continue
            tout.addfile(member, tin.extractfile(member) if member.isreg() else None)


def _flatten(image: str, tag: str, changes: list[str]) -> None:
    """``image`` as ONE layer under ``tag``: export a container of it, import the tree with ``changes``."""
    container = _docker(["create", image, "true"], f"flattening {tag}")
    try:
        export = subprocess.Popen(["docker", "export", container], stdout=subprocess.PIPE)
        argv = ["docker", "import", *[a for c in changes for a in ("--change", c)], "-", tag]
        imp = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        assert export.stdout is not None and imp.stdin is not None
        try:
            _copy_image_files(export.stdout, imp.stdin)
        finally:
            imp.stdin.close()
        err = imp.stderr.read().decode() if imp.stderr else ""
        if export.wait() != 0 or imp.wait() != 0:
            raise RuntimeError(f"flattening {tag}: docker export | docker import failed: {err.strip()[-2000:]}")
    finally:
        subprocess.run(["docker", "rm", "-f", container], capture_output=True)


def _closure(tags: list[str] | None) -> list[Base]:
    """The chosen bases and the stand-ins they are built from, parents first."""
    chosen = [b for b in BASES if tags is None or b.tag in tags]
    unknown = sorted(set(tags or []) - {b.tag for b in BASES})
    if unknown:
        raise ValueError(f"unknown base image(s) {unknown}; offline stand-ins exist for {[b.tag for b in BASES]}")
    names = {b.tag for b in chosen}
    for b in reversed(BASES):  # BASES lists parents first
        if b.tag in names:
            names.add(b.parent)
    return [b for b in BASES if b.tag in names]


def ensure_bases(force: bool = False, tags: list[str] | None = None) -> dict[str, str]:
    """Provide the base images offline; returns ``{tag: "built" | "kept" | "foreign"}``.

    "kept": ours, from this recipe. "foreign": an image under that tag that is not ours (e.g. a real
    one loaded with ``docker load``), left as it is, even with ``force``; ``python:3.12-slim`` is built on
    whatever ``debian:bookworm-slim`` is local. Builds the sandbox base first when it is missing
    (debootstrap), then the stand-ins a chosen one needs, parents first (``python:3.12-slim`` is built
    FROM ``debian:bookworm-slim``, so asking for it provides both).
    """
    todo = _closure(tags)
    if not sandbox_image.image_exists(sandbox_image.BASE_IMAGE):
        sandbox_image.build_base()
    status: dict[str, str] = {}
    for b in todo:
        recipe, label = b.recipe(sandbox_image.image_id(b.parent)), _label(b.tag)
        if label == "":
            status[b.tag] = "foreign"
        elif label == recipe and not force:
            status[b.tag] = "kept"
        else:
            old = sandbox_image.image_id(b.tag) if label else ""
            _build(b, recipe)
            status[b.tag] = "built"
            if old:  # ours from an older recipe, now untagged; kept by Docker while task images use it
                subprocess.run(["docker", "image", "rm", old], capture_output=True)
    return status


def main(argv: list[str] | None = None) -> int:
    """``verl-agent tasks build-bases [--force] [TAG ...]``: prints one line per base image."""
    parser = argparse.ArgumentParser(prog="verl-agent tasks build-bases", description=__doc__.split("\n\n")[0])
    parser.add_argument("tags", nargs="*", help=f"which bases (default: all of {[b.tag for b in BASES]})")
    parser.add_argument("--force", action="store_true", help="rebuild our stand-ins even when up to date")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    try:
        status = ensure_bases(force=args.force, tags=args.tags or None)
    except (RuntimeError, ValueError, subprocess.CalledProcessError) as e:
        print(f"verl-agent tasks build-bases: {e}", file=sys.stderr)
        return 1
    for tag, what in status.items():
        note = {"foreign": "present, not ours: left as it is"}.get(what, what)
        print(f"{tag:<24} {note}")
    print(f"({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
