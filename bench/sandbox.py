"""Sandbox throughput and latency per backend (not a test): prints a table and one JSON line.

Starts the real server (``python -m verl_agent.sandbox.cli serve``) in a subprocess per backend and
drives it over loopback HTTP with a Python hello-world and a ~200 ms CPU task at concurrency 1, 8
and 32. Targets on a 2-core machine: process p50 <= 40 ms and docker p50 <= 80 ms for hello-world;
at concurrency 8, >= 50 (process) and >= 25 (docker) hello-world runs/s.

    .venv/bin/python bench/sandbox.py [--backends process docker] [--pool-size 8] [--requests 120]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time

import httpx

TASKS = {
    "hello": "print('hello world')",
    "cpu200ms": "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.2: pass\nprint('done')",
}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(backend: str, pool_size: int) -> tuple[subprocess.Popen, str]:
    port = _port()
    proc = subprocess.Popen([sys.executable, "-m", "verl_agent.sandbox.cli", "serve", "--backend", backend,
                             "--port", str(port), "--pool-size", str(pool_size), "--max-queue", "1000",
                             "--log-level", "warning"])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/v1/ping", timeout=1).json() == "pong":
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"{backend} server did not start")


async def measure(url: str, code: str, concurrency: int, total: int) -> dict:
    latencies: list[float] = []
    failures = 0
    async with httpx.AsyncClient(base_url=url, timeout=120,
                                 limits=httpx.Limits(max_connections=concurrency)) as http:
        for _ in range(min(concurrency, 4)):  # warm connections and workers
            await http.post("/run_code", json={"code": code, "language": "python"})
        queue = list(range(total))

        async def worker() -> None:
            nonlocal failures
            while queue:
                queue.pop()
                t0 = time.perf_counter()
                r = await http.post("/run_code", json={"code": code, "language": "python"})
                latencies.append(time.perf_counter() - t0)
                failures += r.status_code != 200 or r.json()["status"] != "Success"

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    lat = sorted(latencies)
    return {"runs_per_s": round(len(lat) / wall, 1), "p50_ms": round(statistics.median(lat) * 1000, 1),
            "p99_ms": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1000, 1), "n": len(lat),
            "failures": failures}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backends", nargs="+", default=["process", "docker"])
    ap.add_argument("--pool-size", type=int, default=8)
    ap.add_argument("--requests", type=int, default=120, help="hello-world runs per cell (CPU task: a quarter)")
    args = ap.parse_args()
    rows = []
    for backend in args.backends:
        proc, url = start_server(backend, args.pool_size)
        try:
            for task, code in TASKS.items():
                for conc in (1, 8, 32):
                    n = args.requests if task == "hello" else max(args.requests // 4, conc)
                    rows.append({"backend": backend, "task": task, "concurrency": conc,
                                 **asyncio.run(measure(url, code, conc, n))})
        finally:
            proc.terminate()
            proc.wait(30)
    print(f"{'backend':8} {'task':9} {'conc':>4} {'runs/s':>7} {'p50 ms':>7} {'p99 ms':>7} {'n':>4} {'fail':>4}")
    for r in rows:
        print(f"{r['backend']:8} {r['task']:9} {r['concurrency']:>4} {r['runs_per_s']:>7} {r['p50_ms']:>7} "
              f"{r['p99_ms']:>7} {r['n']:>4} {r['failures']:>4}")
    print(json.dumps({"bench": "sandbox", "pool_size": args.pool_size, "results": rows}))


if __name__ == "__main__":
    main()
