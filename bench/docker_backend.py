"""The docker backend's own costs (not a test), in two sections (``--sections``, default both):

``manage``: what the management calls (the ``docker`` SDK) cost: the backend's start (its isolation
probe) and ``--sandboxes`` (16) sandboxes started 4 at a time (as the pool does) and then destroyed,
in wall time and in CPU seconds of this process (the server's share of a burst's cost).

``attach``: why the attach stream is read by hand: hello-world runs sent straight to warm sandboxes
(no HTTP server) over the two ways of reading a container's attach stream:

- ``asyncio``: the backend's ``AttachedContainer`` (the upgrade and Docker's stream framing read in the
  event loop);
- ``sdk-thread``: the ``docker`` SDK's ``attach_socket`` and its own frame reader
  (``docker.utils.socket.frames_iter``), which block: one thread per sandbox, each reply handed to the
  event loop with ``call_soon_threadsafe``.

p50 latency at concurrency 1 and runs/s at concurrency 8 (one sandbox per client), the two variants
alternated ``--rounds`` times in one process. Figures on a shared 2-core machine are noisy.

    .venv/bin/python bench/docker_backend.py [--sections manage attach] [--sandboxes 16] [--runs 200] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import threading
import time

from docker.utils.socket import frames_iter

from verl_agent.sandbox.api import RunCodeRequest
from verl_agent.sandbox.backends.base import READ_LIMIT, Worker, agent_argv
from verl_agent.sandbox.backends.docker import AttachedContainer, DockerBackend
from verl_agent.sandbox.service import SandboxService


class ThreadedAttach:
    """The SDK's blocking attach socket, read by a thread of its own; shaped like ``AttachedContainer``."""

    def __init__(self, container, sock, loop: asyncio.AbstractEventLoop) -> None:
        self.container, self.sock, self.returncode = container, sock, None
        self.stdout = asyncio.StreamReader(limit=READ_LIMIT)
        self.stdin = self  # write() / drain() below
        self.done = asyncio.Event()
        threading.Thread(target=self._pump, args=(loop,), daemon=True).start()

    def _pump(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            for stream, payload in frames_iter(self.sock, tty=False):
                if stream == 1:
                    loop.call_soon_threadsafe(self.stdout.feed_data, payload)
        except OSError:
            pass
        finally:
            loop.call_soon_threadsafe(self.stdout.feed_eof)
            loop.call_soon_threadsafe(self.done.set)

    def write(self, data: bytes) -> None:
        self.sock._sock.sendall(data)  # the SDK hands the socket over as its SocketIO: writes go to the socket

    async def drain(self) -> None:
        return None

    def close(self) -> None:
        self.sock.close()

    async def wait(self) -> int:
        await self.done.wait()
        self.returncode = -9
        return self.returncode

    def kill(self) -> None:
        self.sock._sock.shutdown(2)


async def start(backend: DockerBackend, variant: str) -> Worker:
    container = await asyncio.to_thread(backend._docker.containers.create, name=backend.new_name("verl-sbx-bench"),
                                        **backend._config(agent_argv()))
    if variant == "asyncio":
        proc = await AttachedContainer.open(container)
    else:
        sock = await asyncio.to_thread(container.attach_socket,
                                       params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1})
        proc = ThreadedAttach(container, sock, asyncio.get_running_loop())
    await asyncio.to_thread(container.start)

    async def destroy() -> None:
        await asyncio.to_thread(container.remove, force=True)

    worker = Worker(container.name, proc, destroy)
    await worker.ready(60)
    return worker


async def measure(backend: DockerBackend, job: dict, variant: str, runs: int) -> dict:
    workers = [await start(backend, variant) for _ in range(8)]
    try:
        lat = []
        for _ in range(runs):
            t0 = time.perf_counter()
            await workers[0].call(job, 30)
            lat.append(time.perf_counter() - t0)

        async def client(w: Worker) -> None:
            for _ in range(runs // 8):
                await w.call(job, 30)

        t0 = time.perf_counter()
        await asyncio.gather(*(client(w) for w in workers))
        rate = (runs // 8 * 8) / (time.perf_counter() - t0)
    finally:
        await asyncio.gather(*(w.destroy() for w in workers))
    return {"variant": variant, "hello_c1_p50_ms": round(statistics.median(lat) * 1000, 1),
            "hello_c8_runs_per_s": round(rate, 1)}


def cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def section_manage(n: int) -> dict:
    t0, c0 = time.perf_counter(), cpu_s()
    backend = DockerBackend(memory_mb=256, pids=64, tmpfs_mb=16)
    start = (time.perf_counter() - t0, cpu_s() - c0)

    async def run() -> tuple[tuple[float, float], tuple[float, float]]:
        slots = asyncio.Semaphore(4)  # the pool's SPAWN_PARALLEL

        async def one() -> Worker:
            async with slots:
                worker = await backend.spawn()
                await worker.ready(60)
                return worker

        t0, c0 = time.perf_counter(), cpu_s()
        workers = await asyncio.gather(*(one() for _ in range(n)))
        up = (time.perf_counter() - t0, cpu_s() - c0)
        t0, c0 = time.perf_counter(), cpu_s()
        await asyncio.gather(*(w.destroy() for w in workers))
        down = (time.perf_counter() - t0, cpu_s() - c0)
        await backend.close()
        return up, down

    up, down = asyncio.run(run())
    res = {"backend_start_s": round(start[0], 2), "sandboxes": n, "start_all_s": round(up[0], 2),
           "start_cpu_ms_per_sandbox": round(up[1] / n * 1000, 1), "destroy_all_s": round(down[0], 2),
           "destroy_cpu_ms_per_sandbox": round(down[1] / n * 1000, 1)}
    print(f"\n== manage ({n} sandboxes, 4 starting at a time) ==")
    for key, value in res.items():
        print(f"{key:32} {value:>10}")
    return res


def section_attach(runs: int, rounds: int) -> list[dict]:
    backend = DockerBackend(memory_mb=256, pids=64, tmpfs_mb=16)
    job, _ = SandboxService(backend)._job(RunCodeRequest(code="print('hello world')", language="python"))

    async def run() -> list[dict]:
        rows = []
        for _ in range(rounds):
            for variant in ("asyncio", "sdk-thread"):
                rows.append(await measure(backend, job, variant, runs))
        await backend.close()
        return rows

    rows = asyncio.run(run())
    print(f"\n== attach ({runs} runs per row) ==")
    print(f"{'attach stream read by':24} {'hello p50 c1 (ms)':>18} {'hello runs/s c8':>16}")
    for r in rows:
        print(f"{r['variant']:24} {r['hello_c1_p50_ms']:>18} {r['hello_c8_runs_per_s']:>16}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", nargs="+", default=["manage", "attach"], choices=["manage", "attach"])
    ap.add_argument("--sandboxes", type=int, default=16, help="manage: sandboxes started and destroyed")
    ap.add_argument("--runs", type=int, default=200, help="attach: hello-world runs per row")
    ap.add_argument("--rounds", type=int, default=2, help="attach: times each variant is measured")
    args = ap.parse_args()
    out: dict = {"bench": "docker_backend"}
    if "manage" in args.sections:
        out["manage"] = section_manage(args.sandboxes)
    if "attach" in args.sections:
        out["attach"] = section_attach(args.runs, args.rounds)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
