"""Trajectory containers on each runtime, measured side by side in one run, a column per runtime (needs the
Docker daemon and the local image verl-agent-sandbox-base:bookworm; the task image is built from it offline
on first use, and exported into the bwrap image store once).

    python bench/containers.py [--runtimes docker,bwrap] [--cold 10] [--warm 20] [--grades 10] [--trajectories 64]

Rows:
  start cold         pool.acquire with no warm container: create + start + shell open (p50/p99)
  start warm         pool.acquire with a warm container ready (p50/p99)
  grade              grading.grade after a one-command episode: seal, tamper and disk checks, test.sh
  bash c=1/16/64     `echo` round trip through the persistent shell at 1, 16, 64 concurrent trajectories
  64 trajectories    64 at once, 10 bash calls each with 0.1-1 s of simulated model time between calls:
                     wall time, errors, bash round trip p50/p99 under that load; once with every container
                     started cold as the trajectories begin, once from a warm pool sized to the batch
  memory per idle    the container's cgroup memory, and its host-side helpers' RSS (containerd-shim; bwrap's
                     monitor and the sandbox's init)
  left behind        this run's containers still present after the pool closed (bwrap: directories + mounts)

    python bench/containers.py --daemon-restart    # root, and a dockerd this machine started (not systemd's)

restarts the Docker daemon under a live pool (4 warm containers, 2 in use) and a trainer killed with SIGKILL
(its 2 containers): rows for the first acquire after the restart, a bash call in it, and the task containers
left on the daemon once the live pool closed and a new pool started (the reaper's start-up sweep).

Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from verl_agent.tasks.grading import grade  # noqa: E402
from verl_agent.tasks.pool import ContainerPool  # noqa: E402
from verl_agent.data.harbor import load_task  # noqa: E402

BASE = "verl-agent-sandbox-base:bookworm"


def make_task(root: Path) -> Path:
    d = root / "bench-echo"
    for sub in ("environment", "tests", "solution"):
        (d / sub).mkdir(parents=True)
    (d / "instruction.md").write_text("Echo things.\n")
    (d / "task.toml").write_text('version = "1.0"\n[verifier]\ntimeout_sec = 30.0\n[agent]\ntimeout_sec = 600.0\n'
                                 "[environment]\ncpus = 1\nmemory_mb = 256\nstorage_mb = 256\n")
    (d / "environment" / "Dockerfile").write_text(f"FROM {BASE}\nWORKDIR /tmp\n")
    (d / "tests" / "test.sh").write_text("#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n")
    (d / "solution" / "solve.sh").write_text("true\n")
    return d


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


async def cold_starts(pool: ContainerPool, task, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        box = await pool.acquire(task)
        out.append(time.perf_counter() - t0)
        await pool.release(box)
    return out


async def warm_starts(pool: ContainerPool, task, n: int) -> list[float]:
    out = []
    for _ in range(n):
        await pool.prewarm(task)
        t0 = time.perf_counter()
        box = await pool.acquire(task)
        out.append(time.perf_counter() - t0)
        assert box.warm
        await pool.release(box)
    return out


async def echo_rtts(boxes: list, calls: int) -> list[float]:
    async def one(box) -> list[float]:
        lat = []
        for i in range(calls):
            t0 = time.perf_counter()
            res = await box.shell.run(f"echo {i}", 30)
            lat.append(time.perf_counter() - t0)
            assert res.output == f"{i}\n", res
        return lat

    return [x for lat in await asyncio.gather(*(one(b) for b in boxes)) for x in lat]


async def trajectories(pool: ContainerPool, task, n: int, calls: int) -> dict:
    rng = random.Random(0)
    lat: list[float] = []
    errors = []

    async def one(k: int) -> None:
        box = await pool.acquire(task)
        try:
            await box.shell.run(f"cd /tmp && mkdir -p t{k} && cd t{k}", 30)
            for i in range(calls):
                await asyncio.sleep(rng.uniform(0.1, 1.0))  # the model thinking
                t0 = time.perf_counter()
                res = await box.shell.run(f"echo {i} >> log && wc -l < log", 30)
                lat.append(time.perf_counter() - t0)
                if res.output.strip() != str(i + 1):
                    errors.append(f"trajectory {k} call {i}: {res.output!r}")
        except Exception as e:
            errors.append(f"trajectory {k}: {type(e).__name__}: {e}")
        finally:
            await pool.release(box)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(k) for k in range(n)))
    return {"wall_s": time.perf_counter() - t0, "errors": len(errors), "first_errors": errors[:3],
            "bash_p50_ms": 1e3 * pct(lat, 50), "bash_p99_ms": 1e3 * pct(lat, 99), "calls": len(lat)}


def idle_memory_mb(pool: ContainerPool, box) -> tuple[float, float]:
    """(container cgroup memory MB, host-side helper RSS MB) of one idle container: Docker's containerd-shim,
    or bwrap's two processes outside the sandbox (its monitor and the sandbox's init)."""
    cg = 0.0
    paths = [f"/sys/fs/cgroup/memory/docker/{box.id}/memory.usage_in_bytes",
             f"/sys/fs/cgroup/system.slice/docker-{box.id}.scope/memory.current",
             f"/sys/fs/cgroup/memory/verl-agent-bwrap/{box.id}/memory.usage_in_bytes",
             f"/sys/fs/cgroup/verl-agent-bwrap/{box.id}/memory.current"]
    for path in paths:
        try:
            cg = int(Path(path).read_text()) / 2**20
            break
        except OSError:
            continue
    helper = 0.0
    marker = box.id if pool.runtime.name == "docker" else box.container.handle["home"]
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cmd = (proc / "cmdline").read_bytes()
            if marker.encode() in cmd and (b"shim" in cmd or b"bwrap" in cmd):
                for line in (proc / "status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        helper += int(line.split()[1]) / 1024
        except OSError:
            continue
    return cg, helper


async def grades(pool: ContainerPool, task, n: int) -> list[float]:
    """Seconds of ``grade`` (seal, tamper and disk checks, the verifier) after a one-command episode."""
    out = []
    for _ in range(n):
        box = await pool.acquire(task)
        await box.shell.run("echo 2 > /tmp/count.txt", 30)
        t0 = time.perf_counter()
        await asyncio.to_thread(grade, pool.runtime, box, task)
        out.append(time.perf_counter() - t0)
        await pool.release(box)
    return out


def left_behind(pool: ContainerPool) -> int:
    """This run's containers still present: Docker's by label; bwrap's directories and mounts."""
    if pool.runtime.name == "docker":
        mine = {"label": f"verl-agent.tasks.run={pool.run_id}"}
        return len(pool.runtime.client.containers.list(all=True, ignore_removed=True, filters=mine))
    state = str(pool.runtime.state_dir)
    dirs = [d for d in Path(state).iterdir() if not d.name.endswith(".grade")]
    return len(dirs) + sum(state in line for line in open("/proc/mounts"))


async def measure(runtime: str, args: argparse.Namespace) -> dict:
    root = Path(tempfile.mkdtemp(prefix="bench-containers-"))
    task = load_task(make_task(root))
    pool = ContainerPool(runtime, warm=0, max_starting=4)
    res: dict = {}
    try:
        await pool.image_for(task)
        t0 = time.perf_counter()
        await pool.image_for(task)
        res["image_cached_s"] = time.perf_counter() - t0
        res["cold"] = await cold_starts(pool, task, args.cold)
        pool.warm = 1
        res["warm"] = await warm_starts(pool, task, args.warm)
        pool.warm = 0
        await asyncio.sleep(1)
        res["grade"] = await grades(pool, task, args.grades)
        boxes = [await pool.acquire(task) for _ in range(64)]
        await echo_rtts(boxes[:1], 20)  # warm the path
        res["c1"] = await echo_rtts(boxes[:1], 200)
        res["c16"] = await echo_rtts(boxes[:16], 40)
        res["c64"] = await echo_rtts(boxes, 20)
        mem = [idle_memory_mb(pool, b) for b in boxes[:8]]
        res["mem_cgroup_mb"] = statistics.mean(m[0] for m in mem)
        res["mem_helper_mb"] = statistics.mean(m[1] for m in mem)
        for b in boxes:
            await pool.release(b)
        res["traj"] = await trajectories(pool, task, args.trajectories, 10)
        await pool.prewarm(task, args.trajectories)  # a warm pool sized to the batch (pool.warm stays 0: no refill)
        res["traj_warm"] = await trajectories(pool, task, args.trajectories, 10)
    finally:
        await pool.close()
    res["left_behind"] = left_behind(pool)
    return res


def summary(r: dict) -> dict:
    ms = lambda xs, q: round(1e3 * pct(xs, q), 1)  # noqa: E731
    t, tw = r["traj"], r["traj_warm"]
    return {
        "start_cold_p50_ms": ms(r["cold"], 50), "start_cold_p99_ms": ms(r["cold"], 99),
        "start_warm_p50_ms": ms(r["warm"], 50), "start_warm_p99_ms": ms(r["warm"], 99),
        "grade_p50_ms": ms(r["grade"], 50), "grade_p99_ms": ms(r["grade"], 99),
        "bash_c1_p50_ms": ms(r["c1"], 50), "bash_c1_p99_ms": ms(r["c1"], 99),
        "bash_c16_p50_ms": ms(r["c16"], 50), "bash_c16_p99_ms": ms(r["c16"], 99),
        "bash_c64_p50_ms": ms(r["c64"], 50), "bash_c64_p99_ms": ms(r["c64"], 99),
        "traj64_wall_s": round(t["wall_s"], 2), "traj64_errors": t["errors"],
        "traj64_bash_p50_ms": round(t["bash_p50_ms"], 1), "traj64_bash_p99_ms": round(t["bash_p99_ms"], 1),
        "traj64_warm_wall_s": round(tw["wall_s"], 2), "traj64_warm_errors": tw["errors"],
        "traj64_warm_bash_p50_ms": round(tw["bash_p50_ms"], 1),
        "traj64_warm_bash_p99_ms": round(tw["bash_p99_ms"], 1),
        "idle_container_cgroup_mb": round(r["mem_cgroup_mb"], 1),
        "idle_container_helper_mb": round(r["mem_helper_mb"], 1),
        "image_cached_ms": round(1e3 * r["image_cached_s"], 1), "containers_left": r["left_behind"],
        "first_errors": t["first_errors"] + tw["first_errors"],
    }


ROWS = [("start cold p50 / p99 (ms)", "start_cold_p50_ms", "start_cold_p99_ms"),
        ("start warm p50 / p99 (ms)", "start_warm_p50_ms", "start_warm_p99_ms"),
        ("grade p50 / p99 (ms)", "grade_p50_ms", "grade_p99_ms"),
        ("bash echo c=1 p50 / p99 (ms)", "bash_c1_p50_ms", "bash_c1_p99_ms"),
        ("bash echo c=16 p50 / p99 (ms)", "bash_c16_p50_ms", "bash_c16_p99_ms"),
        ("bash echo c=64 p50 / p99 (ms)", "bash_c64_p50_ms", "bash_c64_p99_ms"),
        ("64 traj. cold: wall (s) / errors", "traj64_wall_s", "traj64_errors"),
        ("64 traj. cold: bash p50 / p99 (ms)", "traj64_bash_p50_ms", "traj64_bash_p99_ms"),
        ("64 traj. warm pool: wall (s) / errors", "traj64_warm_wall_s", "traj64_warm_errors"),
        ("64 traj. warm pool: bash p50 / p99 (ms)", "traj64_warm_bash_p50_ms", "traj64_warm_bash_p99_ms"),
        ("idle container: cgroup / host helper (MB)", "idle_container_cgroup_mb", "idle_container_helper_mb"),
        ("image, second lookup (ms)", "image_cached_ms", None),
        ("containers left behind", "containers_left", None)]


def report(results: dict[str, dict]) -> dict:
    """A column per runtime, then one JSON line: {runtime: figures}."""
    out = {name: summary(r) for name, r in results.items()}
    cells = [[label] + [f"{o[a]} / {o[b]}" if b else str(o[a]) for o in out.values()] for label, a, b in ROWS]
    header = ["", *out]
    widths = [max(len(row[i]) for row in [header, *cells]) for i in range(len(header))]
    for row in [header, *cells]:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
    for name, o in out.items():
        errors = o.pop("first_errors")
        if errors:
            print(f"errors ({name}):", *errors, sep="\n  ")
    print(json.dumps(out))
    return out


KILLED_TRAINER = """
import asyncio, sys
from verl_agent.tasks.pool import ContainerPool
from verl_agent.data.harbor import load_task

async def main():
    pool = ContainerPool("docker", warm=0)
    boxes = [await pool.acquire(load_task(sys.argv[1])) for _ in range(2)]
    print(pool.owner, flush=True)
    await asyncio.sleep(600)

asyncio.run(main())
"""


def restart_dockerd(timeout: float = 60.0) -> float:
    """SIGTERM the running dockerd, start a new one as scripts/setup_docker.sh does; seconds until it answers."""
    pid = int(subprocess.run(["pidof", "dockerd"], capture_output=True, text=True, check=True).stdout.split()[0])
    t0 = time.perf_counter()
    os.kill(pid, signal.SIGTERM)
    while os.path.exists(f"/proc/{pid}") and time.perf_counter() - t0 < timeout:
        time.sleep(0.1)
    log = open(os.environ.get("DOCKERD_LOG", "/tmp/verl-agent-dockerd.log"), "a")
    subprocess.Popen(["dockerd"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    while subprocess.run(["docker", "info"], capture_output=True).returncode:
        if time.perf_counter() - t0 > timeout:
            raise RuntimeError(f"dockerd did not answer within {timeout} s of its restart")
        time.sleep(0.2)
    return time.perf_counter() - t0


async def daemon_restart() -> dict:
    root = Path(tempfile.mkdtemp(prefix="bench-containers-"))
    task_dir = make_task(root)
    task = load_task(task_dir)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    trainer = subprocess.Popen([sys.executable, "-c", KILLED_TRAINER, str(task_dir)], stdout=subprocess.PIPE,
                               text=True, env=env)
    trainer.stdout.readline()
    trainer.send_signal(signal.SIGKILL)
    trainer.wait()
    pool = ContainerPool("docker", warm=0)
    res: dict = {}
    try:
        await pool.prewarm(task, 4)
        in_use = [await pool.acquire(task) for _ in range(2)]
        res["restart_s"] = restart_dockerd()
        t0 = time.perf_counter()
        box = await pool.acquire(task)
        res["acquire_s"] = time.perf_counter() - t0
        res["warm_dead"] = pool.stats["warm_dead"]
        res["echo"] = (await box.shell.run("echo ok")).output.strip()
        for b in [*in_use, box]:
            await pool.release(b)
    finally:
        await pool.close()
    ContainerPool("docker", warm=0).close_sync()  # a new pool's start reaps the killed trainer's containers
    res["left"] = len(pool.runtime.client.containers.list(all=True, ignore_removed=True,
                                                  filters={"label": "verl-agent.tasks=1"}))
    return res


def report_restart(r: dict) -> dict:
    rows = [("daemon restart (s)", f"{r['restart_s']:.1f}"),
            ("first acquire after it (ms)", f"{1e3 * r['acquire_s']:.0f} ({r['warm_dead']} dead warm containers "
                                            "skipped)"),
            ("bash in it", r["echo"]),
            ("task containers left (all runs)", str(r["left"]))]
    w = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{w}}  {v}" for k, v in rows))
    out = {"daemon_restart_s": round(r["restart_s"], 1), "acquire_after_restart_ms": round(1e3 * r["acquire_s"]),
           "warm_dead": r["warm_dead"], "echo_after_restart": r["echo"], "containers_left_after_restart": r["left"]}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cold", type=int, default=10)
    p.add_argument("--warm", type=int, default=20)
    p.add_argument("--trajectories", type=int, default=64)
    p.add_argument("--grades", type=int, default=10, help="episodes graded for the grade row")
    p.add_argument("--runtimes", default="docker,bwrap", help="comma-separated: a column each")
    p.add_argument("--daemon-restart", action="store_true", help="only the daemon-restart rows (see above)")
    a = p.parse_args()
    if a.daemon_restart:
        report_restart(asyncio.run(daemon_restart()))
    else:
        report({name: asyncio.run(measure(name, a)) for name in a.runtimes.split(",")})
