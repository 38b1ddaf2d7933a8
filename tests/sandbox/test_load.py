"""The pool under load (issue 18): elastic growth and shrink, CPU shared instead of queued (timeouts on
time, queue wait reported apart), overload answered without losing a request, and a sandbox whose
PID 1 is killed answered cleanly and replaced while other clients carry on.

Short versions of ``bench/sandbox.py``'s sections (which run 60 s / 100 kills and print the figures).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid

import httpx
import pytest
from sandbox_helpers import agent_of, host_pid

from verl_agent.sandbox.backends.base import WorkerPool
from verl_agent.sandbox.backends.process import ProcessBackend
from verl_agent.sandbox.client import ClientLimits, SandboxClient
from verl_agent.sandbox.service import ServiceSettings


def pool_stats(server) -> dict:
    return httpx.get(f"{server.url}/v1/health").json()["pool"]


@pytest.fixture(scope="module")
def elastic_server(server_thread_cls):
    """Process backend, 1 warm, up to 4, idle sandboxes destroyed after 1 s."""
    settings = ServiceSettings(min_pool_size=1, max_pool_size=4, pool_idle_timeout=1.0, max_queue=64,
                               default_memory_mb=256)
    with server_thread_cls(ProcessBackend(memory_mb=256, tmpfs_mb=16), settings) as server:
        yield server


def test_pool_grows_on_demand_to_max_and_shrinks_back_to_min(elastic_server, run):
    server = elastic_server
    server.wait_idle()
    assert pool_stats(server)["total"] == 1
    code = "import time\ntime.sleep(0.8)\nprint('ok')"
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(6) as ex:
        outs = list(ex.map(lambda _: run(server, code), range(6)))
    assert [o["run_result"]["stdout"] for o in outs] == ["ok\n"] * 6
    stats = pool_stats(server)
    assert stats["peak"] == 4, stats  # grew past the warm minimum, never past the maximum
    assert len({o["executor_pod_name"] for o in outs}) == 4
    waited = sorted(o["queue_time"] for o in outs)
    assert waited[-1] >= 0.5, waited  # 6 runs on 4 sandboxes: two waited for a free one, and say so
    deadline = time.monotonic() + 10
    while pool_stats(server)["total"] > 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    stats = pool_stats(server)
    assert stats["total"] == stats["idle"] == 1 and stats["shrunk"] >= 3, stats  # back to the warm minimum


def test_a_timed_out_sandbox_is_reused_when_clean(elastic_server, run):
    server = elastic_server
    server.wait_idle()
    deadline = time.monotonic() + 10
    while pool_stats(server)["total"] > 1 and time.monotonic() < deadline:
        time.sleep(0.1)  # one sandbox: the next run lands where the spin ran
    assert pool_stats(server)["total"] == 1
    recycled = pool_stats(server)["recycled"]
    out = run(server, "while True: pass", run_timeout=0.5)
    assert out["run_result"]["status"] == "TimeLimitExceeded"
    assert pool_stats(server)["recycled"] == recycled  # killed and wiped by the agent: not destroyed
    after = run(server, "import os\nprint(sorted(os.listdir('/tmp')), [p for p in os.listdir('/proc') if p.isdigit()])")
    assert after["executor_pod_name"] == out["executor_pod_name"]
    assert after["run_result"]["stdout"].startswith("['sandbox'] ['1', "), after  # nothing left of the spin


async def test_pool_waiters_are_served_in_order_and_a_timeout_gives_up_cleanly():
    backend = ProcessBackend(memory_mb=128, tmpfs_mb=8)
    pool = WorkerPool(backend, min_size=1, max_size=1, idle_timeout=5.0)
    await pool.start()
    try:
        held = await pool.acquire()
        order: list[int] = []

        async def take(i: int) -> None:
            w = await pool.acquire(timeout=10)
            order.append(i)
            pool.release(w, dirty=False)

        waiters = [asyncio.ensure_future(take(i)) for i in range(3)]
        await asyncio.sleep(0.05)
        with pytest.raises(asyncio.TimeoutError):
            await pool.acquire(timeout=0.1)  # a full pool at its maximum: the wait times out ...
        assert pool.waiting() == 3  # ... and leaves the queue
        pool.release(held, dirty=False)
        await asyncio.gather(*waiters)
        assert order == [0, 1, 2] and pool.stats()["total"] == 1 and pool.stats()["busy"] == 0
    finally:
        await pool.close()
        await backend.close()


@pytest.mark.parametrize("kwargs,match", [
    (dict(min_pool_size=5, max_pool_size=4), "min_pool_size=5, max_pool_size=4"),
    (dict(min_pool_size=-1), "min_pool_size=-1"),
    (dict(min_pool_size=0, max_pool_size=0), "max_pool_size >= 1"),
    (dict(pool_idle_timeout=0), "pool_idle_timeout must be > 0"),
    (dict(max_queue=-1), "max_queue must be >= 0"),
    (dict(crash_respawn_rate=0), "crash_respawn_rate must be > 0 per second"),
    (dict(crash_respawn_burst=-1), "crash_respawn_burst must be >= 0"),
])
def test_settings_are_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ServiceSettings(**kwargs)


# -- docker: saturation, overload, killed PID 1 ----------------------------------------------------------


def test_concurrent_timeouts_share_cpu_and_come_back_on_time(docker_server):
    """``max_pool_size`` spinning runs at once, twice: the first burst grows the pool (the runs that
    waited for a sandbox say how long); in the second every run has a sandbox of its own at once, and
    all of them share the CPU and time out on their own deadline instead of queueing."""
    server = docker_server
    server.wait_idle()
    n, timeout = server.service.settings.max_pool_size, 1.0
    assert n == 2 * server.service.settings.min_pool_size

    async def burst() -> list[tuple[float, dict]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            async def one() -> tuple[float, dict]:
                t0 = time.monotonic()
                r = await http.post("/run_code", json={"code": "while True: pass", "language": "python",
                                                        "run_timeout": timeout})
                return time.monotonic() - t0, r.json()

            return await asyncio.gather(*(one() for _ in range(n)))

    grew = pool_stats(server)["total"] < n  # earlier tests on this shared server may have grown it already
    for grown in (False, True):
        outs = asyncio.run(burst())
        for e2e, out in outs:
            assert out["run_result"]["status"] == "TimeLimitExceeded", out
            assert timeout <= out["run_result"]["execution_time"] < timeout + 1.0, out  # its own deadline
            assert e2e >= out["queue_time"] + timeout - 0.05
            assert e2e - out["queue_time"] - out["run_result"]["execution_time"] < 2.0, (e2e, out)
        if not grown:
            assert pool_stats(server)["peak"] == n  # grew past the warm minimum to the maximum
            assert max(o["queue_time"] for _, o in outs) > 0 or not grew  # some waited, and were told
        else:
            assert len({o["executor_pod_name"] for _, o in outs}) == n  # all at once, one sandbox each
            assert all(o["queue_time"] < 0.5 for _, o in outs), [o["queue_time"] for _, o in outs]
            assert max(e2e for e2e, _ in outs) < timeout + 2.5, sorted(e2e for e2e, _ in outs)


def test_overload_every_request_answered_none_lost(server_thread_cls, docker_backend_cls):
    """4x the pool's maximum of clients for a few seconds with a short queue: the server answers 503 +
    Retry-After beyond the queue, the client retries, and every request ends with its result."""
    settings = ServiceSettings(min_pool_size=1, max_pool_size=2, max_queue=2, default_memory_mb=256)
    with server_thread_cls(docker_backend_cls(memory_mb=256, pids=32, tmpfs_mb=16), settings) as server:
        clients, seconds = 4 * settings.max_pool_size, 4.0

        async def load() -> tuple[list[str], list[float], dict]:
            outs, lat = [], []
            limits = ClientLimits(overload_retry_s=60.0, max_concurrency=clients, max_connections=clients)
            async with SandboxClient(server.url, limits) as client:
                stop = time.monotonic() + seconds

                async def loop(i: int) -> None:
                    k = 0
                    while time.monotonic() < stop:
                        t0 = time.monotonic()
                        out = await client.run_code(f"print({i}, {k})")
                        lat.append(time.monotonic() - t0)
                        outs.append(out.run_result.stdout if out.run_result else out.message)
                        assert out.run_result.stdout == f"{i} {k}\n", out  # its own answer, not another's
                        k += 1

                await asyncio.gather(*(loop(i) for i in range(clients)))
                return outs, lat, dict(client.retried)

        outs, lat, retried = asyncio.run(load())
        overloaded = server.service.stats["overloaded"]
    assert len(outs) >= clients and len(outs) == len(lat)  # every request answered: none lost
    assert overloaded > 0 and retried["overloaded"] == overloaded, (overloaded, retried)  # 503s did happen
    assert sorted(lat)[int(len(lat) * 0.99) - 1] < 30.0


def test_killing_a_sandboxs_pid1_is_a_clean_error_and_others_carry_on(docker_server):
    """One client's sandbox loses its PID 1 (SIGKILL from the host) 3 times while two others run:
    the victim gets a clean SandboxError each time, the others all succeed, the pool refills."""
    server = docker_server
    server.wait_idle()

    async def scenario() -> tuple[list, list[float], list]:
        async with SandboxClient(server.url) as client:
            done, lat, others = asyncio.Event(), [], []

            async def other() -> None:
                while not done.is_set():
                    t0 = time.monotonic()
                    others.append(await client.run_code("print('fine')"))
                    lat.append(time.monotonic() - t0)

            loops = [asyncio.ensure_future(other()) for _ in range(2)]
            victims = []
            for _ in range(3):
                marker = f"{uuid.uuid4().int % 10**6}.{uuid.uuid4().int % 997}"
                pending = asyncio.ensure_future(client.run_code(f"sleep {marker}", "bash", run_timeout=30))
                pid = await asyncio.to_thread(host_pid, f"sleep\0{marker}")
                os.kill(agent_of(pid), signal.SIGKILL)
                victims.append(await pending)
            done.set()
            await asyncio.gather(*loops)
            return victims, lat, others

    victims, lat, others = asyncio.run(scenario())
    for v in victims:
        assert v.status.value == "SandboxError" and "crashed" in v.message and "replaced" in v.message, v
    assert others and all(o.status.value == "Success" and o.run_result.stdout == "fine\n" for o in others)
    assert max(lat) < 5.0, sorted(lat)[-5:]  # no stall behind the replacements
    server.wait_idle()  # refilled to the warm minimum
    assert pool_stats(server)["idle"] >= server.service.settings.min_pool_size
