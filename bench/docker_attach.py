"""Why the docker backend reads its attach stream by hand (not a test): hello-world runs sent straight to
warm sandboxes (no HTTP server) over the two ways of reading a container's attach stream:

- ``asyncio``: the backend's ``AttachedContainer`` (the upgrade and Docker's stream framing read in the
  event loop);
- ``sdk-thread``: the ``docker`` SDK's ``attach_socket`` and its own frame reader
  (``docker.utils.socket.frames_iter``), which block: one thread per sandbox, each reply handed to the
  event loop with ``call_soon_threadsafe``.

p50 latency at concurrency 1 and runs/s at concurrency 8 (one sandbox per client), the two variants
alternated ``--rounds`` times in one process. Figures on a shared 2-core machine are noisy.

    .venv/bin/python bench/docker_attach.py [--runs 200] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    backend = DockerBackend(memory_mb=256, pids=64, tmpfs_mb=16)
    job, _ = SandboxService(backend)._job(RunCodeRequest(code="print('hello world')", language="python"))

    async def run() -> list[dict]:
        rows = []
        for _ in range(args.rounds):
            for variant in ("asyncio", "sdk-thread"):
                rows.append(await measure(backend, job, variant, args.runs))
        await backend.close()
        return rows

    rows = asyncio.run(run())
    print(f"{'attach stream read by':24} {'hello p50 c1 (ms)':>18} {'hello runs/s c8':>16}")
    for r in rows:
        print(f"{r['variant']:24} {r['hello_c1_p50_ms']:>18} {r['hello_c8_runs_per_s']:>16}")
    print(json.dumps({"bench": "docker_attach", "rows": rows}))


if __name__ == "__main__":
    main()
