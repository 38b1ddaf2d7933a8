"""Isolation of trajectory containers, on both runtimes (docker, bwrap): each case runs an escape attempt
inside a container made exactly as the pool makes them and asserts it is contained, then runs the SAME
attempt in a twin with one guarantee removed and asserts the attempt now succeeds, so each check is shown
to detect the escape it guards against. A twin is the runtime's own configuration minus that guarantee:
Docker's ``container_kwargs`` edited, or bwrap's command line edited (``Twin``). bwrap sets
no-new-privileges unconditionally, so that one case has no bwrap twin (``NO_TWIN``). Bombs are bounded
(a few hundred processes, a few hundred MB) so the weakened twins cannot hurt the machine."""

from __future__ import annotations

import os
import re
import socket
import tempfile
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
from task_helpers import SLIM_DOCKERFILE, make_task, needs_docker

from verl_agent.containers import LABEL, OWNER_LABEL, RUN_LABEL, Container, ContainerSpec, owner_id
from verl_agent.containers.docker import container_kwargs
from verl_agent.tasks.pool import ContainerPool
from verl_agent.tasks.shell import Shell
from verl_agent.data.harbor import load_task

pytestmark = [needs_docker, pytest.mark.docker]

RUN = f"security-{uuid.uuid4().hex[:8]}"
NO_TWIN = {("bwrap", "test_no_new_privileges"): "bwrap sets PR_SET_NO_NEW_PRIVS unconditionally"}


@pytest.fixture(scope="module", params=["docker", "bwrap"])
def env(request, tmp_path_factory):
    task = load_task(make_task(tmp_path_factory.mktemp("security"), "slim", dockerfile=SLIM_DOCKERFILE))
    pool = ContainerPool(request.param, warm=0, run_id=RUN)
    secret_dir = Path(tempfile.mkdtemp(prefix="verl-agent-host-secret-", dir="/tmp"))
    secret_dir.chmod(0o755)  # readable by anyone on the host: only the container boundary keeps it out
    (secret_dir / "secret.txt").write_text("HOST-SECRET-7f3a\n")
    yield {"runtime": pool.runtime, "task": task, "image": pool._image_for(task), "secret_dir": secret_dir,
           "name": request.param}
    import shutil

    shutil.rmtree(secret_dir, ignore_errors=True)
    pool.close_sync()


@dataclass
class Twin:
    """One guarantee removed: from Docker's create kwargs, from bwrap's command line, or from the spec."""

    docker: Callable[[dict], Any] | None = None
    bwrap: Callable[[list[str]], list[str]] | None = None
    spec: dict[str, Any] = field(default_factory=dict)


def _insert(*args: str) -> Callable[[list[str]], list[str]]:
    """bwrap options added before the command (the first lone ``--``)."""
    return lambda argv: argv[:argv.index("--")] + list(args) + argv[argv.index("--"):]


def _drop(flag: str) -> Callable[[list[str]], list[str]]:
    return lambda argv: [a for a in argv if a != flag]


class Box:
    """A started container with the pool's configuration (minus what `twin` removes) and its shell."""

    def __init__(self, env: dict, twin: Twin | None = None, **limits: Any) -> None:
        twin = twin or Twin()
        spec = ContainerSpec(image=env["image"], user="10001", cpus=1, memory_mb=limits.get("memory_mb", 256),
                             storage_mb=limits.get("storage_mb", 64), pids=limits.get("pids", 64), lifetime_s=300)
        spec = replace(spec, **twin.spec)
        labels = {LABEL: "1", RUN_LABEL: RUN, OWNER_LABEL: owner_id()}
        self.runtime = rt = env["runtime"]
        if env["name"] == "docker":
            kw = container_kwargs(spec, labels)
            if twin.docker:
                twin.docker(kw)
            c = rt.client.containers.create(**kw)
            c.start()
            self.container = Container(c.id, spec, "docker", spec.user, "/app", labels)
        else:
            self.container = rt.start(spec, labels)
        original = rt._argv if env["name"] == "bwrap" else None
        weakened = (lambda *a, **k: twin.bwrap(original(*a, **k))) if twin.bwrap and original else None
        with mock.patch.object(rt, "_argv", weakened) if weakened else _nothing():
            self.shell = Shell(rt, self.container).open()

    async def sh(self, cmd: str, timeout: float = 60) -> str:
        res = await self.shell.run(cmd, timeout)
        return res.output

    def close(self) -> None:
        self.shell.close()
        self.runtime.destroy(self.container)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


async def both(env: dict, twin: Twin, attempt: Callable[[Box], Any], **limits: Any) -> tuple[Any, Any]:
    """(attempt in the pool's container, attempt in the weakened twin)."""
    out = []
    for t in (None, twin):
        box = Box(env, t, **limits)
        try:
            out.append(await attempt(box))
        finally:
            box.close()
    return out[0], out[1]


NETWORK = Twin(docker=lambda kw: (kw.pop("network_disabled"), kw.__setitem__("network_mode", "bridge")),
               bwrap=_drop("--unshare-net"))


async def test_host_filesystem_is_not_reachable(env):
    secret: Path = env["secret_dir"]

    async def attempt(b: Box) -> str:
        return await b.sh(f"cat {secret}/secret.txt /host{secret}/secret.txt 2>/dev/null; echo end")

    twin = Twin(docker=lambda kw: kw.__setitem__("volumes", {"/": {"bind": "/host", "mode": "ro"}}),
                bwrap=_insert("--ro-bind", "/", "/host"))
    safe, weak = await both(env, twin, attempt)
    assert "HOST-SECRET" not in safe and "HOST-SECRET-7f3a" in weak


async def test_docker_socket_is_absent(env):
    probe = ("python3 -c \"import socket; s=socket.socket(socket.AF_UNIX); s.connect('/var/run/docker.sock'); "
             "s.sendall(b'GET /_ping HTTP/1.0\\r\\n\\r\\n'); print(s.recv(200))\" 2>&1 | tail -1")

    def weaken(kw: dict) -> None:  # the socket mounted, and (as on many hosts) a user in the docker group
        kw["volumes"] = {"/var/run/docker.sock": {"bind": "/var/run/docker.sock", "mode": "rw"}}
        kw["group_add"] = [str(Path("/var/run/docker.sock").stat().st_gid)]

    twin = Twin(docker=weaken, bwrap=_insert("--bind", "/var/run/docker.sock", "/run/docker.sock"),
                spec={"user": "0"} if env["name"] == "bwrap" else {})
    if env["name"] == "docker":
        twin.spec = {"user": f"10001:{Path('/var/run/docker.sock').stat().st_gid}"}
    safe, weak = await both(env, twin, lambda b: b.sh(probe))
    assert "No such file" in safe and "HTTP/1.0 200 OK" in weak


def _host_server() -> tuple[socket.socket, list, threading.Thread]:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", 0))
    srv.listen()
    srv.settimeout(20)
    got: list = []

    def serve() -> None:
        try:
            while True:
                conn, addr = srv.accept()
                got.append(addr)
                conn.close()
        except OSError:
            pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return srv, got, t


async def test_network_reaches_neither_the_host_nor_the_internet(env):
    srv, got, _ = _host_server()
    port = srv.getsockname()[1]
    attempt = f"(echo hi > /dev/tcp/172.17.0.1/{port}) 2>&1 && echo CONNECTED; echo end"
    try:
        safe, weak = await both(env, NETWORK, lambda b: b.sh(attempt, 20))
    finally:
        srv.close()
    assert "CONNECTED" not in safe and "unreachable" in safe.lower()
    assert "CONNECTED" in weak and len(got) == 1  # only the twin reached the host's server


async def test_only_loopback_exists(env):
    attempt = "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' ' | sort | tr '\\n' ,"
    safe, weak = await both(env, NETWORK, lambda b: b.sh(attempt))
    assert safe == "lo," and "eth0" in weak


async def test_other_containers_processes_are_invisible(env):
    other = Box(env)
    try:
        await other.sh("sleep 4242 &")
        # the bracket keeps grep's own command line, racing the glob, from matching
        attempt = "cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' ' | grep -c '[s]leep 4242'"
        twin = Twin(docker=lambda kw: kw.__setitem__("pid_mode", "host"), bwrap=_drop("--unshare-pid"))
        safe, weak = await both(env, twin, lambda b: b.sh(attempt))
    finally:
        other.close()
    assert safe.strip() == "0" and int(weak.strip()) >= 1


async def test_tests_and_solution_are_not_in_the_container_before_grading(env):
    task = env["task"]
    attempt = "ls /tests /solution 2>&1; find / -xdev \\( -name test.sh -o -name solve.sh \\) 2>/dev/null; echo end"

    async def run(b: Box) -> str:
        return await b.sh(attempt)

    box = Box(env)
    try:
        safe = await run(box)
    finally:
        box.close()
    twin = Box(env)  # the weakened order: the verifier's files copied in before the agent's turn
    try:
        twin.runtime.copy_in(twin.container, task.tests_dir, "tests")
        twin.shell.reopen()
        weak = await run(twin)
    finally:
        twin.close()
    assert "/tests/test.sh" not in safe and "No such file" in safe and "/tests/test.sh" in weak


async def test_fork_bomb_is_contained(env):
    attempt = ("python3 -c \"import subprocess\nn = 0\nfor i in range(300):\n    try:\n"
               "        subprocess.Popen(['sleep', '120']); n += 1\n    except OSError:\n        break\n"
               "print('SPAWNED', n)\"; echo alive")
    twin = Twin(docker=lambda kw: kw.__setitem__("pids_limit", -1), spec={"pids": 4096})
    safe, weak = await both(env, twin, lambda b: b.sh(attempt, 60), pids=64)
    assert safe.endswith("alive\n") and 0 < int(safe.split()[1]) < 64
    assert weak.split()[:2] == ["SPAWNED", "300"]


async def test_memory_bomb_is_contained(env):
    attempt = ("python3 -c \"b = bytearray(400 << 20); b[::4096] = b'x' * len(b[::4096]); print('ALLOC' + 'ATED')\"; "
               "echo exit=$?")
    twin = Twin(docker=lambda kw: (kw.pop("mem_limit"), kw.pop("memswap_limit")), spec={"memory_mb": 2048})
    safe, weak = await both(env, twin, lambda b: b.sh(attempt, 60), memory_mb=128)
    assert "ALLOCATED" not in safe and ("exit=137" in safe or "MemoryError" in safe)
    assert "ALLOCATED" in weak


async def test_disk_bomb_is_contained(env):
    attempt = "head -c 48M /dev/zero > /tmp/fill 2>&1; echo exit=$?; stat -c %s /tmp/fill; rm -f /tmp/fill"
    twin = Twin(docker=lambda kw: kw.__setitem__("ulimits", [u for u in kw["ulimits"] if u["Name"] != "fsize"]),
                spec={"storage_mb": 256} if env["name"] == "bwrap" else {})
    safe, weak = await both(env, twin, lambda b: b.sh(attempt, 60), storage_mb=16)
    assert "exit=0" not in safe and int(safe.split()[-1]) <= 17 << 20
    assert "exit=0" in weak and int(weak.split()[-1]) == 48 << 20


async def test_agent_is_not_root(env):
    safe, weak = await both(env, Twin(spec={"user": "0"}), lambda b: b.sh("id -u"))
    assert safe == "10001\n" and weak == "0\n"


async def test_no_new_privileges(env):
    attempt = "grep NoNewPrivs /proc/self/status | tr -d '\\t '"
    if (env["name"], "test_no_new_privileges") in NO_TWIN:
        box = Box(env)
        try:
            assert await box.sh(attempt) == "NoNewPrivs:1\n"
        finally:
            box.close()
        return
    safe, weak = await both(env, Twin(docker=lambda kw: kw.pop("security_opt")), lambda b: b.sh(attempt))
    assert safe == "NoNewPrivs:1\n" and weak == "NoNewPrivs:0\n"


async def test_capabilities_are_dropped(env):
    """The agent holds no capability; its bounding set is empty (bwrap) or ROOT_CAPS, which only root
    processes (the verifier) use: no-new-privileges keeps file capabilities from granting them."""
    attempt = "grep -E 'CapBnd|CapEff' /proc/self/status | tr -d '\\t ' | sort | tr '\\n' ,"
    twin = Twin(docker=lambda kw: (kw.pop("cap_drop"), kw.pop("cap_add")), bwrap=_drop("--bounding-set=-all"))
    safe, weak = await both(env, twin, lambda b: b.sh(attempt))

    def caps(out: str) -> tuple[int, int]:
        found = dict(part.split(":") for part in out.strip(",\n").split(","))
        return int(found["CapBnd"], 16), int(found["CapEff"], 16)

    allowed = sum(1 << n for n in (0, 1, 3, 4, 6, 7))  # CHOWN DAC_OVERRIDE FOWNER FSETID SETGID SETUID
    (bnd, eff), (weak_bnd, _) = caps(safe), caps(weak)
    assert eff == 0 and bnd & ~allowed == 0 and (bnd == 0 or env["name"] == "docker")
    assert weak_bnd & ~allowed != 0


async def test_host_devices_are_not_exposed(env):
    attempt = "ls /dev | grep -cE '^(vd|sd|nvme|xvd)[a-z0-9]*$'"
    disks = [f"/dev/{d}" for d in os.listdir("/dev") if re.fullmatch(r"(vd|sd|nvme|xvd)[a-z0-9]*", d)]
    twin = Twin(docker=lambda kw: kw.__setitem__("devices", [f"{d}:{d}:r" for d in disks]),
                bwrap=_insert("--dev-bind", "/dev", "/dev"))
    safe, weak = await both(env, twin, lambda b: b.sh(attempt))
    assert safe.strip() == "0" and int(weak.strip()) >= 1


def test_every_case_has_a_twin():
    """Each case above runs its attempt in a weakened twin too (through ``both``, or, for the grading
    order, a ``twin`` Box of its own), on both runtimes but where ``NO_TWIN`` says why not."""
    import inspect

    cases = {n: f for n, f in globals().items() if n.startswith("test_") and n != "test_every_case_has_a_twin"}
    assert len(cases) == 13
    marks = ("await both(", "twin = Box(")
    untwinned = [n for n, f in cases.items() if not any(m in inspect.getsource(f) for m in marks)]
    assert untwinned == [], untwinned
    assert len(NO_TWIN) == 1
