"""verl_agent.tasks.bases: the offline stand-ins for debian:bookworm-slim and python:3.12-slim.

They are what real Harbor tasks start FROM; here they are built from the sandbox's debootstrapped Debian
base (scripts/setup_docker.sh builds them). The checks: what each image really holds, that it says what
it is, that a second call builds nothing, and that a bad name is refused.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from verl_agent.tasks.bases import BASES, RECIPE_LABEL, ensure_bases, main


def _docker_ready() -> bool:
    from verl_agent.sandbox.backends.docker import docker_available
    from verl_agent.sandbox.image import BASE_IMAGE, image_exists

    ok = docker_available() and image_exists(BASE_IMAGE)
    if not ok and os.environ.get("CI") == "true":
        pytest.fail("CI=true but Docker or the sandbox base image is missing (scripts/setup_docker.sh)")
    return ok


@pytest.fixture(scope="module")
def bases() -> dict[str, str]:
    if not _docker_ready():
        pytest.skip("needs Docker and the sandbox base image")
    return ensure_bases()


def _run(image: str, script: str) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", "run", "--rm", "--network", "none", image, "bash", "-c", script],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.docker
def test_second_call_builds_nothing(bases):
    assert set(bases) == {"debian:bookworm-slim", "python:3.12-slim"}
    again = ensure_bases()
    # ours from this recipe are kept; an image that is not ours under that tag is left alone ("foreign")
    assert all(again[b.tag] in ("kept", "foreign") for b in BASES) and "built" not in again.values()


@pytest.mark.docker
def test_debian_stand_in_is_slim_and_runs_as_root(bases):
    if bases["debian:bookworm-slim"] == "foreign":
        pytest.skip("a debian:bookworm-slim that is not ours is present")
    r = _run("debian:bookworm-slim", "id -u; pwd; command -v python3 g++ node; dpkg-query -W | wc -l; "
                                     "grep -c . /etc/debian_version")
    uid, cwd, *rest = r.stdout.split()
    assert (uid, cwd) == ("0", "/") and rest[0].isdigit()  # python3, g++ and node are all gone
    assert 60 <= int(rest[0]) <= 120  # about the real image's package count


@pytest.mark.docker
def test_python_stand_in_is_debians_python_and_says_so(bases):
    if bases["python:3.12-slim"] == "foreign":
        pytest.skip("a python:3.12-slim that is not ours is present")
    r = _run("python:3.12-slim", "python -c 'import sys; print(*sys.version_info[:2])'; pip --version; "
                                 "python -m venv --without-pip /tmp/v && /tmp/v/bin/python -c 'print(1)'; "
                                 "command -v g++ || echo no-gcc")
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and lines[0] == "3 11" and lines[1].startswith("pip ") and lines[2:] == ["1", "no-gcc"]
    labels = subprocess.run(["docker", "image", "inspect", "-f", "{{json .Config.Labels}}", "python:3.12-slim"],
                            capture_output=True, text=True).stdout
    assert '"org.verl-agent.python":"3.11"' in labels and RECIPE_LABEL in labels


@pytest.mark.docker
def test_bases_are_slim_and_share_the_debian_layer(bases):
    if "foreign" in bases.values():
        pytest.skip("a base image that is not ours is present")

    def inspect(tag: str, field: str):
        out = subprocess.run(["docker", "image", "inspect", "-f", f"{{{{json {field}}}}}", tag],
                             capture_output=True, text=True, check=True).stdout
        return json.loads(out)

    debian, python = (inspect(t, ".RootFS.Layers") for t in ("debian:bookworm-slim", "python:3.12-slim"))
    # one flat layer, and python:3.12-slim one layer on top of it: `docker save` of both carries Debian once
    assert len(debian) == 1 and len(python) == 2 and python[0] == debian[0]
    assert inspect("debian:bookworm-slim", ".Config.Cmd") == ["bash"]
    assert inspect("debian:bookworm-slim", ".Size") < 90e6 and inspect("python:3.12-slim", ".Size") < 150e6
    r = _run("python:3.12-slim", "find /usr/share/doc -type f ! -name copyright | wc -l; find /usr/share/man "
                                 "/usr/share/info /usr/share/locale /var/lib/apt/lists -mindepth 1 | wc -l; "
                                 "grep -c '^path-exclude' /etc/dpkg/dpkg.cfg.d/docker; "
                                 "grep -c '^sandbox:' /etc/passwd; "
                                 "ls /usr/lib/python3.11/__pycache__ | grep -c 'os.cpython'")
    # no docs, man/info pages, translations or apt lists, and dpkg keeps later installs so; no sandbox
    # user; the standard library's byte-code kept (a non-root python3 start would compile it every time)
    assert r.stdout.split() == ["0", "0", "7", "0", "1"], r.stdout + r.stderr


def test_unknown_base_is_refused(capsys):  # before any Docker call
    with pytest.raises(ValueError, match=r"unknown base image\(s\) \['alpine:3.20'\]"):
        ensure_bases(tags=["alpine:3.20"])
    assert main(["alpine:3.20"]) == 1 and "alpine:3.20" in capsys.readouterr().err
