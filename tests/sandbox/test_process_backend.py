"""Process backend start-up: what it claims is probed in a real sandbox (and its cgroups from the host);
a weakened sandbox is refused naming the guarantee; what it does not claim is reported, not refused."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from verl_agent.sandbox.backends.probe import GUARANTEES, IsolationError, judge
from verl_agent.sandbox.backends.process import CGROUP_ROOT, ProcessBackend

SMALL = dict(memory_mb=256, pids=32, tmpfs_mb=16)


@pytest.mark.parametrize("guarantee", GUARANTEES)
def test_a_weakened_sandbox_is_refused_naming_the_guarantee(guarantee):
    """Every guarantee, removed alone (the backend's test-only ``weaken``), is measured as failed by the
    start-up probe; a backend that claims it refuses to serve, naming it."""
    if guarantee in ("memory_limit", "pids_limit", "cpu_limit") and not ProcessBackend._cgroup_ok(None):
        pytest.skip("no writable cgroup v1 hierarchy: the cgroup limits are not claimed here")
    backend = ProcessBackend(**SMALL, uid=31000, weaken=frozenset({guarantee}))
    try:
        ok, detail = backend._guarantees[guarantee]
        assert not ok and guarantee not in backend.claimed(), detail
        with pytest.raises(IsolationError, match=f"process backend: isolation guarantee failed at start-up: "
                                                 f".*{guarantee} .*refusing to serve"):
            judge("process", backend._guarantees, set(GUARANTEES))
    finally:
        asyncio.run(backend.close())


def test_unknown_weakening_is_refused():
    with pytest.raises(ValueError, match=r"weaken=\['no_such'\] unknown"):
        ProcessBackend(**SMALL, weaken=frozenset({"no_such"}))


def test_claimed_guarantees_are_measured():
    backend = ProcessBackend(**SMALL)
    found = backend._guarantees
    assert set(found) == set(GUARANTEES)
    assert all(found[k][0] for k in backend.claimed()), found
    if backend._cgroups:  # root with cgroup v1 here: limits read from the kernel, from outside the sandbox
        assert found["memory_limit"][1].endswith(f"limit {256 << 20}")
        assert found["pids_limit"][1].endswith("pids.max 32")
        assert backend.guarantees() == dict.fromkeys(GUARANTEES, True)
    asyncio.run(backend.close())


def test_unclaimed_cgroup_limits_are_reported_not_refused():
    class NoCgroups(ProcessBackend):
        def _cgroup_ok(self):
            return False

    backend = NoCgroups(**SMALL)
    g = backend.guarantees()
    assert not g["memory_limit"] and not g["pids_limit"] and not g["cpu_limit"]
    assert all(g[k] for k in set(GUARANTEES) - {"memory_limit", "pids_limit", "cpu_limit"})
    assert "not claimed" in backend._guarantees["memory_limit"][1]


def test_a_backend_removes_only_its_own_cgroups():
    a, b = ProcessBackend(**SMALL), ProcessBackend(**SMALL)
    if not a._cgroups:
        pytest.skip("no writable cgroup v1 hierarchy")

    async def scenario():
        wa, wb = await a.spawn(), await b.spawn()
        await wa.ready(30)
        await wb.ready(30)
        mine = CGROUP_ROOT / "memory" / "verl-sandbox" / a.instance_id / wa.name
        theirs = CGROUP_ROOT / "memory" / "verl-sandbox" / b.instance_id / wb.name
        assert mine.is_dir() and theirs.is_dir()
        restarted = await asyncio.to_thread(ProcessBackend, instance_id=a.instance_id, **SMALL)  # after a crash
        assert not mine.exists() and theirs.is_dir()
        assert wa.proc.returncode is not None or await asyncio.wait_for(wa.proc.wait(), 5) is not None
        assert wb.proc.returncode is None  # the other server's sandbox runs on
        await wb.destroy()
        await wa.destroy()
        for backend in (a, b, restarted):
            await backend.close()
        assert not Path(CGROUP_ROOT / "memory" / "verl-sandbox" / b.instance_id).exists()

    asyncio.run(scenario())


@pytest.mark.parametrize("flags,message", [
    (["--min-pool-size", "5", "--max-pool-size", "2"], "min_pool_size=5, max_pool_size=2"),
    (["--pool-idle-timeout", "0"], "pool_idle_timeout must be > 0"),
    (["--crash-respawn-rate", "0"], "crash_respawn_rate must be > 0"),
    (["--instance-id", "../x"], "instance_id must be letters, digits and '-'"),
])
def test_serve_refuses_bad_settings_with_a_clear_message(flags, message):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "verl_agent.sandbox.cli", "serve", "--backend", "process", "--port",
                           "9", *flags], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and message in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_instance_id_reaches_the_backend():
    from verl_agent.sandbox.cli import make_backend

    backend = make_backend("process", memory_mb=256, instance_id="run-42")
    assert backend.instance_id == "run-42"
    asyncio.run(backend.close())
