"""Isolation of trajectory containers: each case runs an escape attempt inside a container made exactly as
the pool makes them (container_kwargs) and asserts it is contained, then runs the SAME attempt in a twin
with one guarantee removed and asserts the attempt now succeeds, so each check is shown to detect the
escape it guards against. Bombs are bounded (a few hundred processes, a few hundred MB) so the weakened
twins cannot hurt the machine."""

from __future__ import annotations

import shutil
import socket
import tempfile
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from task_helpers import needs_docker

from verl_agent.tasks.container import LABEL, OWNER_LABEL, RUN_LABEL, ContainerSpec, container_kwargs, owner_id
from verl_agent.tasks.grading import copy_dir
from verl_agent.tasks.image import ensure_image
from verl_agent.tasks.shell import Shell
from verl_agent.data.harbor import load_task

pytestmark = [needs_docker, pytest.mark.docker]

RUN = f"security-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def env(count_task):
    import docker

    client = docker.from_env()
    task = load_task(count_task)
    secret_dir = Path(tempfile.mkdtemp(prefix="verl-agent-host-secret-", dir="/tmp"))
    secret_dir.chmod(0o755)  # readable by anyone on the host: only the container boundary keeps it out
    (secret_dir / "secret.txt").write_text("HOST-SECRET-7f3a\n")
    yield {"client": client, "task": task, "image": ensure_image(task, client), "secret_dir": secret_dir}
    shutil.rmtree(secret_dir, ignore_errors=True)
    for c in client.containers.list(all=True, ignore_removed=True, filters={"label": f"{RUN_LABEL}={RUN}"}):
        c.remove(force=True)


class Box:
    """A started container with the pool's configuration (minus what `weaken` removes) and its shell."""

    def __init__(self, env: dict, weaken: Callable[[dict], Any] | None = None, **limits: Any) -> None:
        spec = ContainerSpec(image=env["image"], user="", cpus=1, memory_mb=limits.get("memory_mb", 256),
                             storage_mb=limits.get("storage_mb", 64), pids=limits.get("pids", 64), lifetime_s=300)
        labels = {LABEL: "1", RUN_LABEL: RUN, OWNER_LABEL: owner_id()}
        kw = container_kwargs(spec, labels, image_user="10001")
        if weaken:
            weaken(kw)
        self.client = env["client"]
        self.container = self.client.containers.create(**kw)
        self.container.start()
        self.shell = Shell(self.client, self.container.id, user=kw.get("user") or "", workdir="/app").open()

    async def sh(self, cmd: str, timeout: float = 60) -> str:
        res = await self.shell.run(cmd, timeout)
        return res.output

    def close(self) -> None:
        self.shell.close()
        self.container.remove(force=True)


async def both(env: dict, weaken: Callable[[dict], Any], attempt: Callable[[Box], Any], **limits: Any):
    """(attempt in the pool's container, attempt in the weakened twin)."""
    out = []
    for w in (None, weaken):
        box = Box(env, w, **limits)
        try:
            out.append(await attempt(box))
        finally:
            box.close()
    return out


def _set(key: str, value: Any) -> Callable[[dict], None]:
    return lambda kw: kw.__setitem__(key, value)


async def test_host_filesystem_is_not_reachable(env):
    secret: Path = env["secret_dir"]

    async def attempt(b: Box) -> str:
        return await b.sh(f"cat {secret}/secret.txt /host{secret}/secret.txt 2>/dev/null; echo end")

    safe, weak = await both(env, _set("volumes", {"/": {"bind": "/host", "mode": "ro"}}), attempt)
    assert "HOST-SECRET" not in safe and "HOST-SECRET-7f3a" in weak


async def test_docker_socket_is_absent(env):
    probe = ("python3 -c \"import socket; s=socket.socket(socket.AF_UNIX); s.connect('/var/run/docker.sock'); "
             "s.sendall(b'GET /_ping HTTP/1.0\\r\\n\\r\\n'); print(s.recv(200))\" 2>&1 | tail -1")

    def weaken(kw: dict) -> None:  # the socket mounted, and (as on many hosts) a user in the docker group
        kw["volumes"] = {"/var/run/docker.sock": {"bind": "/var/run/docker.sock", "mode": "rw"}}
        kw["group_add"] = [str(Path("/var/run/docker.sock").stat().st_gid)]

    safe, weak = await both(env, weaken, lambda b: b.sh(probe))
    assert "No such file" in safe and "HTTP/1.0 200 OK" in weak


def _host_server() -> tuple[int, list, threading.Thread]:
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
        safe, weak = await both(env, lambda kw: (kw.pop("network_disabled"), kw.__setitem__("network_mode", "bridge")),
                                lambda b: b.sh(attempt, 20))
    finally:
        srv.close()
    assert "CONNECTED" not in safe and "unreachable" in safe.lower()
    assert "CONNECTED" in weak and len(got) == 1  # only the twin reached the host's server


async def test_only_loopback_exists(env):
    attempt = "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' ' | sort | tr '\\n' ,"
    safe, weak = await both(env, lambda kw: (kw.pop("network_disabled"), kw.__setitem__("network_mode", "bridge")),
                            lambda b: b.sh(attempt))
    assert safe == "lo," and "eth0" in weak


async def test_other_containers_processes_are_invisible(env):
    other = Box(env)
    try:
        await other.sh("sleep 4242 &")
        # the bracket keeps grep's own command line, racing the glob, from matching
        attempt = "cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' ' | grep -c '[s]leep 4242'"
        safe, weak = await both(env, _set("pid_mode", "host"), lambda b: b.sh(attempt))
    finally:
        other.close()
    assert safe.strip() == "0" and int(weak.strip()) >= 1


async def test_tests_and_solution_are_not_in_the_container_before_grading(env):
    task = env["task"]
    attempt = "ls /tests /solution 2>&1; find / -xdev \\( -name test.sh -o -name solve.sh \\) 2>/dev/null; echo end"

    async def run(b: Box) -> str:
        return await b.sh(attempt)

    safe = await run(Box(env))
    twin = Box(env)  # the weakened order: the verifier's files copied in before the agent's turn
    try:
        copy_dir(env["client"], twin.container.id, task.tests_dir, "tests")
        weak = await run(twin)
    finally:
        twin.close()
    assert "/tests/test.sh" not in safe and "No such file" in safe and "/tests/test.sh" in weak


async def test_fork_bomb_is_contained(env):
    attempt = ("python3 -c \"import subprocess\nn = 0\nfor i in range(300):\n    try:\n"
               "        subprocess.Popen(['sleep', '120']); n += 1\n    except OSError:\n        break\n"
               "print('SPAWNED', n)\"; echo alive")
    safe, weak = await both(env, _set("pids_limit", -1), lambda b: b.sh(attempt, 60), pids=64)
    assert safe.endswith("alive\n") and 0 < int(safe.split()[1]) < 64
    assert weak.split()[:2] == ["SPAWNED", "300"]


async def test_memory_bomb_is_contained(env):
    attempt = ("python3 -c \"b = bytearray(400 << 20); b[::4096] = b'x' * len(b[::4096]); print('ALLOC' + 'ATED')\"; "
               "echo exit=$?")
    safe, weak = await both(env, lambda kw: (kw.pop("mem_limit"), kw.pop("memswap_limit")),
                            lambda b: b.sh(attempt, 60), memory_mb=128)
    assert "ALLOCATED" not in safe and "exit=137" in safe
    assert "ALLOCATED" in weak


async def test_disk_bomb_is_contained(env):
    attempt = "head -c 48M /dev/zero > /tmp/fill 2>&1; echo exit=$?; stat -c %s /tmp/fill; rm -f /tmp/fill"
    safe, weak = await both(env, lambda kw: kw.__setitem__("ulimits", [u for u in kw["ulimits"]
                                                                        if u["Name"] != "fsize"]),
                            lambda b: b.sh(attempt, 60), storage_mb=16)
    assert "exit=0" not in safe and int(safe.split()[-1]) <= 16 << 20
    assert "exit=0" in weak and int(weak.split()[-1]) == 48 << 20


async def test_agent_is_not_root(env):
    safe, weak = await both(env, _set("user", "0"), lambda b: b.sh("id -u"))
    assert safe == "10001\n" and weak == "0\n"


async def test_no_new_privileges(env):
    attempt = "grep NoNewPrivs /proc/self/status | tr -d '\\t '"
    safe, weak = await both(env, lambda kw: kw.pop("security_opt"), lambda b: b.sh(attempt))
    assert safe == "NoNewPrivs:1\n" and weak == "NoNewPrivs:0\n"


async def test_capabilities_are_dropped(env):
    attempt = "grep CapBnd /proc/self/status | tr -d '\\t '"
    safe, weak = await both(env, lambda kw: kw.pop("cap_drop"), lambda b: b.sh(attempt))
    assert safe == "CapBnd:0000000000000000\n" and weak != safe and weak.startswith("CapBnd:")


async def test_host_devices_are_not_exposed(env):
    attempt = "ls /dev | grep -cE '^(vd|sd|nvme|xvd)[a-z0-9]*$'"
    safe, weak = await both(env, _set("privileged", True), lambda b: b.sh(attempt))
    assert safe.strip() == "0" and int(weak.strip()) >= 1


def test_every_case_has_a_twin():
    """Each case above runs its attempt in a weakened twin too: through ``both``, or (the grading order) a
    ``twin`` Box of its own."""
    import inspect

    cases = {n: f for n, f in globals().items() if n.startswith("test_") and n != "test_every_case_has_a_twin"}
    assert len(cases) == 13
    marks = ("await both(", "twin = Box(")
    untwinned = [n for n, f in cases.items() if not any(m in inspect.getsource(f) for m in marks)]
    assert untwinned == [], untwinned
