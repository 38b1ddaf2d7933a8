"""Peak memory of every documented CPU training command, against the host's RAM and the memory planner's estimate.

  python bench/memory.py                       # every CPU command found, 2 steps each
  python bench/memory.py --list                # only list the commands found
  python bench/memory.py --only calculator smollm2 --steps 1

Commands are read from README.md, docs/*.md and examples/*/README.md: every `verl-agent train` command (and
`make demo`) that runs on CPU, i.e. that neither asks for a GPU (trainer.device=cuda, n_gpus_per_node >= 1)
nor uses a config that does without overriding it (trainer.n_gpus_per_node=0). Commands that are shell loops
over placeholders ($M, MODE) are skipped; their plain form is covered by the command without them. Each runs as
written plus `--steps` steps, no validation, no checkpoints and a run directory of its own (so the step count and
the start-up dominate less than in the full run, but a step's peak is the same). `$(python .../warm_start.py)`
(SmolLM2's tool-call warm start, 7 minutes of SFT on 2 cores) becomes the base model `smollm2` unless
--warm-start is given: the same shapes, so the same memory per token, on the untrained model's lengths.

While a command runs, the RSS of its whole process tree (the CLI, Ray's daemons and workers) is summed from
/proc every 0.25 s. Each train rank logs its plan (`memory plan: ... estimated peak X GiB`, verl_agent/
trainer/memory.py); the table sets it against that rank's measured peak RSS. Targets: the tree's peak at
most 80 % of RAM for every command; the estimate within 25 % of the measured rank peak for the calculator and
SmolLM2 commands. Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RAM_TARGET, ESTIMATE_TARGET = 0.80, 0.25
_GIB = 2**30
SANDBOX_URL = "http://127.0.0.1:8080"  # the port the examples' tool configs name
_OVERRIDDEN = {"trainer.total_training_steps", "trainer.test_freq", "data.val_files", "trainer.save_freq"}
_GPU = re.compile(r"trainer\.device=cuda|n_gpus_per_node=[1-9]")
_PLAN = re.compile(r"pid=(\d+).*memory plan: micro-batch budget (\d+) tokens.*estimated peak ([\d.]+) GiB"
                   r".*activations ([\d.]+)")


@dataclass
class Command:
    name: str  # example folder (or file) it comes from
    source: str  # file:line
    argv: list[str]  # arguments of `verl-agent`
    cwd: Path
    sandbox: bool = False  # its README starts a sandbox server first (`verl-agent sandbox serve`)


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """Lines of a markdown file with backslash continuations joined, leading `$ ` / indentation removed."""
    out, buf, start = [], "", 0
    for i, line in enumerate(text.splitlines(), 1):
        if not buf:
            start = i
        stripped = line.strip()
        if stripped.endswith("\\"):
            buf += stripped[:-1] + " "
            continue
        out.append((start, (buf + stripped).strip()))
        buf = ""
    return out


def _config_wants_gpu(config: Path) -> bool:
    import yaml

    data = yaml.safe_load(config.read_text()) or {}
    return int((data.get("trainer") or {}).get("n_gpus_per_node", 0) or 0) > 0


def discover(warm_start: str) -> list[Command]:
    """Documented CPU training commands, one per distinct command line."""
    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted(REPO.glob("examples/*/README.md"))]
    seen, out = set(), []
    for path in files:
        cwd = REPO
        sandbox = "verl-agent sandbox serve" in path.read_text()
        for lineno, line in _logical_lines(path.read_text()):
            if line.startswith("```") or not line:  # a `cd` holds until the end of its block
                cwd = REPO
                continue
            if line.startswith("cd "):
                cwd = (REPO / line.split()[1]).resolve()
                continue
            line = line.split("#", 1)[0].strip().rstrip("`").lstrip("`")
            if line.startswith("make demo"):
                line = "verl-agent train examples/calculator/config.yaml"
            m = re.search(r"(?:^|/)verl-agent train (.*)$", line)
            if not m or "$M" in line or "$S" in line or "MODE" in line or "..." in line:
                continue
            rest = m.group(1).replace("$(python examples/smollm2_calculator/warm_start.py)", warm_start)
            if "$" in rest or _GPU.search(rest):
                continue
            argv = shlex.split(rest)
            config = next((a for a in argv if a.endswith(".yaml") and "=" not in a), None)
            if config and not (cwd / config).exists():
                continue
            if config and _config_wants_gpu(cwd / config) and "trainer.n_gpus_per_node=0" not in argv:
                continue
            key = (str(cwd), tuple(a for a in argv if a.split("=")[0] not in _OVERRIDDEN))
            if key in seen:
                continue
            seen.add(key)
            rel = path.relative_to(REPO)
            folder = Path(config).parent.name if config else "quickstart" if path.name == "README.md" else path.stem
            name = rel.parts[1] if rel.parts[0] == "examples" else folder
            out.append(Command(name, f"{rel}:{lineno}", argv, cwd, sandbox))
    return out


@dataclass
class Peaks:
    """Peak RSS of a process tree (summed) and of each process in it, sampled from /proc in a thread."""

    root: int
    period: float = 0.25
    tree: int = 0
    per_pid: dict[int, int] = field(default_factory=dict)
    names: dict[int, str] = field(default_factory=dict)
    hwm: dict[int, int] = field(default_factory=dict)  # the kernel's own peak RSS (VmHWM): no sample missed

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Peaks:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            rss = tree_rss(self.root)
            self.tree = max(self.tree, sum(rss.values()))
            for pid, value in rss.items():
                if value > self.per_pid.get(pid, 0):
                    self.per_pid[pid] = value
                    self.names.setdefault(pid, _cmdline(pid))
                self.hwm[pid] = max(self.hwm.get(pid, 0), _hwm(pid))
            if self._stop.wait(self.period):
                return


def _hwm(pid: int) -> int:
    try:
        line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration, ValueError, IndexError):
        return 0


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:120]
    except OSError:
        return ""


def tree_rss(root: int) -> dict[int, int]:
    """RSS in bytes of `root` and all its descendants, by pid."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo, page = {}, [root], os.sysconf("SC_PAGE_SIZE")
    while todo:
        pid = todo.pop()
        todo += children.get(pid, [])
        try:
            out[pid] = int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * page
        except (OSError, IndexError, ValueError):
            continue
    return out


def ram_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@contextmanager
def sandbox_server(wanted: bool, env: dict[str, str]) -> Iterator[None]:
    """The sandbox server a README starts before its command (process backend, the documented port), measured
    apart from the command's tree: it is a separate service, not part of the training run."""
    if not wanted:
        yield
        return
    server = subprocess.Popen([sys.executable, "-m", "verl_agent", "sandbox", "serve", "--backend", "process"],
                              cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        for _ in range(120):
            try:
                urllib.request.urlopen(f"{SANDBOX_URL}/v1/health", timeout=1)
                break
            except OSError:
                time.sleep(0.5)
        else:
            raise RuntimeError(f"the sandbox server did not answer on {SANDBOX_URL} within 60 s")
        yield
    finally:
        server.terminate()
        server.wait(timeout=30)


# docs/environments.md's template names the user's own tasks; the bench gives it the terminal-task suite
_STAND_INS = {"my-tasks/train": "examples/terminal_tasks/tasks/train",
              "my-tasks/val": "examples/terminal_tasks/tasks/heldout",
              "tools.yaml": "examples/terminal_tasks/tools.yaml"}


def _cwd_with_stand_ins(cmd: Command, work: Path) -> Path:
    """The command's folder, or, where it names placeholder paths that do not exist, a folder that has them."""
    names = [n for n in _STAND_INS if any(n in a for a in cmd.argv) and not (cmd.cwd / n).exists()]
    if not names:
        return cmd.cwd
    cwd = work / "cwd"
    for n in names:
        (cwd / n).parent.mkdir(parents=True, exist_ok=True)
        (cwd / n).symlink_to(REPO / _STAND_INS[n])
    return cwd


def run(cmd: Command, steps: int, timeout: float) -> dict:
    """Run one command for `steps` steps; its peaks, the plans its ranks logged, and how it ended."""
    work = Path(tempfile.mkdtemp(prefix=f"bench_memory_{cmd.name}_"))
    cwd = _cwd_with_stand_ins(cmd, work)
    extra = [f"trainer.total_training_steps={steps}", "trainer.val_before_train=false", "data.val_files=[]",
             "trainer.save_freq=-1", "trainer.logger=[console]", f"trainer.default_local_dir={work}",
             "trainer.resume_mode=disable"]
    argv = [sys.executable, "-m", "verl_agent", "train", *cmd.argv, *extra]
    ray_tmp = tempfile.mkdtemp(prefix="rb", dir="/tmp")  # short: Ray's socket paths must stay under 107 bytes
    env = {**os.environ, "PYTHONPATH": str(REPO), "RAY_TMPDIR": ray_tmp}
    t0 = time.time()
    log = work / "output.log"
    with open(log, "w") as out, sandbox_server(cmd.sandbox, env):
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
        with Peaks(proc.pid) as peaks:
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
    text = log.read_text(errors="replace")
    plans = {int(m.group(1)): (int(m.group(2)), float(m.group(3)) * _GIB, float(m.group(4)) * _GIB)
             for m in _PLAN.finditer(text)}
    widest = _widest_micro_batch(work / "metrics.jsonl")
    ranks = []
    for pid, (tokens, est, act) in sorted(plans.items()):
        ran = est - act * (1 - min(widest, tokens) / tokens) if widest else est  # activations of what ran
        measured = peaks.per_pid.get(pid, 0)
        ranks.append({"pid": pid, "budget_tokens": tokens, "widest_tokens": widest, "plan_estimate_gib": est / _GIB,
                      "estimate_gib": ran / _GIB, "measured_gib": measured / _GIB,
                      "error": ran / measured - 1 if measured else None})
    tail = [line for line in text.splitlines() if line.strip()][-3:]
    if rc == 0:  # the run's exported model and Ray's session files; a failed run keeps them (and its log)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    return {"name": cmd.name, "source": cmd.source, "rc": rc, "seconds": round(time.time() - t0, 1),
            "peak_tree_gib": peaks.tree / _GIB, "peak_tree_of_ram": peaks.tree / ram_bytes(), "ranks": ranks,
            "log": str(log), "tail": tail if rc else []}


def _widest_micro_batch(metrics: Path) -> int:
    """The largest micro-batch (padded tokens, mean of the ranks) over the run's steps (0 if none ran)."""
    if not metrics.exists():
        return 0
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return int(max((r.get("perf/max_micro_batch_tokens", 0) for r in rows), default=0))


def report(results: list[dict]) -> dict:
    head = f"{'command':<22} {'source':<42} {'rc':>3} {'s':>6} {'tree GiB':>9} {'% RAM':>6} " \
           f"{'rank peak':>10} {'estimate':>9} {'error':>7} {'budget':>7} {'ran':>6} {'plan est':>9}"
    print(head)
    print("-" * len(head))
    ok = True
    for r in results:
        ranks = r["ranks"] or [{}]
        for i, k in enumerate(ranks):
            first = i == 0
            err = k.get("error")
            print(f"{r['name'] if first else '':<22} {r['source'] if first else '':<42} "
                  f"{r['rc'] if first else '':>3} {r['seconds'] if first else '':>6} "
                  f"{r['peak_tree_gib'] if first else 0:>9.2f} {100 * r['peak_tree_of_ram'] if first else 0:>6.1f} "
                  f"{k.get('measured_gib', 0):>10.2f} {k.get('estimate_gib', 0):>9.2f} "
                  f"{'' if err is None else f'{100 * err:+.1f}%':>7} {k.get('budget_tokens', ''):>7} "
                  f"{k.get('widest_tokens', ''):>6} {k.get('plan_estimate_gib', 0):>9.2f}")
        for line in r["tail"]:
            print(f"    {line[:160]}")
        r["fits"] = r["rc"] == 0 and r["peak_tree_of_ram"] <= RAM_TARGET
        r["estimate_ok"] = bool(r["ranks"]) and all(k["error"] is not None and abs(k["error"]) <= ESTIMATE_TARGET
                                                    for k in r["ranks"])
        ok &= r["fits"] and (r["estimate_ok"] or r["name"] not in ("calculator", "smollm2_calculator"))
    summary = {"bench": "memory", "ram_gib": ram_bytes() / _GIB, "cpus": os.cpu_count(), "all_targets_met": ok,
               "results": [{k: v for k, v in r.items() if k not in ("tail", "log")} for r in results]}
    print(json.dumps(summary))
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--only", nargs="*", help="run only the commands of these example names")
    ap.add_argument("--list", action="store_true", help="list the commands found and exit")
    ap.add_argument("--warm-start", action="store_true", help="build/use SmolLM2's warm start (7 min of SFT)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per command")
    args = ap.parse_args()
    warm = "smollm2"
    if args.warm_start:
        warm = subprocess.run([sys.executable, "examples/smollm2_calculator/warm_start.py"], cwd=REPO, check=True,
                              capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}
                              ).stdout.strip().splitlines()[-1]
    cmds = [c for c in discover(warm) if not args.only or c.name in args.only]
    if args.list:
        for c in cmds:
            print(f"{c.name:<22} {c.source:<42} (cwd {c.cwd.relative_to(REPO)}) verl-agent train {shlex.join(c.argv)}")
        return
    report([run(c, args.steps, args.timeout) for c in cmds])


if __name__ == "__main__":
    main()
