"""Offline stand-ins for the base images Harbor tasks start ``FROM``: ``debian:bookworm-slim``, ``python:3.12-slim``.

No registry is reachable on our machines, so these cannot be pulled. Both are derived from the sandbox's
offline base image (``verl_agent.sandbox.image``: Debian bookworm debootstrapped from the apt mirror with
python3, g++ and nodejs), so one debootstrap serves the sandbox and both bases; each is one ``docker build``
on top of it that purges packages and shares its lower layer on disk.

``debian:bookworm-slim``
    Every package that is neither Debian-required nor apt is purged; what stays (bash, coreutils, grep,
    sed, findutils, tar, gzip, apt, ...) is about what the real image holds. root, ``WORKDIR /``, ``CMD ["bash"]``.
``python:3.12-slim``
    Debian bookworm's own ``python3``, which is **Python 3.11**: bookworm has no 3.12 package and nothing can
    be downloaded from python.org here. It keeps python3 and ca-certificates, adds ``pip``, ``venv`` and the
    ``python`` command from Debian's packages (one ``apt-get install`` from the same mirror), and lets pip
    install system-wide as the real image does (Debian's PEP 668 marker is removed). The image says what it
    is: label ``org.verl-agent.python=3.11`` and ``org.verl-agent.stand-in-for=python:3.12-slim``. A task
    that needs 3.12-only features fails here and needs a real image (``docker load`` it under that tag).

A public tag is given only where no such image exists locally: a real (or any foreign) image under that
name is never replaced. One of ours built from an older recipe (its ``org.verl-agent.base-recipe`` label
differs) is rebuilt; one from this recipe is kept, so a second call only inspects two images.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from verl_agent.sandbox import image as sandbox_image

__all__ = ["BASES", "Base", "ensure_bases", "main"]

RECIPE_LABEL = "org.verl-agent.base-recipe"

# Mark every package auto-installed except `keep`, then let apt remove what nothing manual needs.
# Works offline: the sandbox base has no apt lists, and autoremove reads only dpkg's status.
_PURGE = (
    "mkdir -p /var/lib/apt/lists/partial"
    " && apt-mark auto $(dpkg-query -W -f '${{Package}}\\n') >/dev/null"
    " && apt-mark manual apt {keep} >/dev/null"
    " && apt-mark manual $(dpkg-query -W -f '${{Package}} ${{Priority}}\\n'"
    " | awk '$2==\"required\"{{print $1}}') >/dev/null"
    " && DEBIAN_FRONTEND=noninteractive apt-get -y -q autoremove --purge >/dev/null"
)
_CLEAN = " && apt-get clean && rm -rf /var/lib/apt/lists/* /var/log/apt /var/log/dpkg.log"

_DEBIAN = f"""\
ARG BASE_IMAGE
FROM ${{BASE_IMAGE}}
USER root
RUN {_PURGE.format(keep="")}{_CLEAN}
LABEL org.verl-agent.stand-in-for="debian:bookworm-slim" org.verl-agent.debian="bookworm"
ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
WORKDIR /
CMD ["bash"]
"""

_PYTHON = f"""\
ARG BASE_IMAGE
FROM ${{BASE_IMAGE}}
USER root
RUN {_PURGE.format(keep="python3 ca-certificates")} \\
 && apt-get -q update >/dev/null \\
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \\
      python3-pip python3-venv python-is-python3 >/dev/null \\
 && rm -f /usr/lib/python3*/EXTERNALLY-MANAGED{_CLEAN}
LABEL org.verl-agent.stand-in-for="python:3.12-slim" org.verl-agent.python="3.11" \\
      org.verl-agent.debian="bookworm"
ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 PYTHONUNBUFFERED=1
WORKDIR /
CMD ["python3"]
"""


@dataclass(frozen=True)
class Base:
    """One stand-in: the public tag it takes and the Dockerfile that derives it from the sandbox base."""

    tag: str
    dockerfile: str

    def recipe(self, base_image: str) -> str:
        """A hash of the recipe and of the image it starts from: it changes when either does."""
        text = self.dockerfile + sandbox_image.image_id(base_image)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


BASES = (Base("debian:bookworm-slim", _DEBIAN), Base("python:3.12-slim", _PYTHON))


def _label(tag: str) -> str | None:
    """Our recipe label on a local image; "" for an image that is not ours; None when there is no image."""
    out = subprocess.run(["docker", "image", "inspect", "-f", f'{{{{index .Config.Labels "{RECIPE_LABEL}"}}}}', tag],
                         capture_output=True, text=True)
    if out.returncode != 0:
        return None
    value = out.stdout.strip()
    return "" if value in ("", "<no value>") else value


def _build(base: Base, base_image: str, recipe: str) -> None:
    text = base.dockerfile + f'LABEL {RECIPE_LABEL}="{recipe}"\n'
    with tempfile.TemporaryDirectory(prefix="verl-task-base-") as ctx:
        (Path(ctx) / "Dockerfile").write_text(text)
        argv = ["docker", "build", "-q", "--build-arg", f"BASE_IMAGE={base_image}", "-t", base.tag, ctx]
        out = subprocess.run(argv, capture_output=True, text=True, env=sandbox_image._legacy_builder_env())
    if out.returncode != 0:
        raise RuntimeError(f"building the offline stand-in for {base.tag} failed (it needs the Debian mirror "
                           f"for pip/venv): {out.stderr.strip()[-2000:]}")


def ensure_bases(force: bool = False, tags: list[str] | None = None) -> dict[str, str]:
    """Provide the base images offline; returns ``{tag: "built" | "kept" | "foreign"}``.

    "kept": ours, from this recipe. "foreign": an image under that tag that is not ours (e.g. a real
    one loaded with ``docker load``), left as it is, even with ``force``. Builds the sandbox base first
    when it is missing (debootstrap), then the missing stand-ins side by side.
    """
    chosen = [b for b in BASES if tags is None or b.tag in tags]
    unknown = sorted(set(tags or []) - {b.tag for b in BASES})
    if unknown:
        raise ValueError(f"unknown base image(s) {unknown}; offline stand-ins exist for {[b.tag for b in BASES]}")
    if not sandbox_image.image_exists(sandbox_image.BASE_IMAGE):
        sandbox_image.build_base()
    status: dict[str, str] = {}
    todo: list[tuple[Base, str]] = []
    for b in chosen:
        recipe, label = b.recipe(sandbox_image.BASE_IMAGE), _label(b.tag)
        if label == "":
            status[b.tag] = "foreign"
        elif label == recipe and not force:
            status[b.tag] = "kept"
        else:
            todo.append((b, recipe))
    with ThreadPoolExecutor(max_workers=max(1, len(todo))) as pool:  # apt's download overlaps the other purge
        list(pool.map(lambda t: _build(t[0], sandbox_image.BASE_IMAGE, t[1]), todo))
    status.update({b.tag: "built" for b, _ in todo})
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
