"""Fault injection into real training runs: CPU, the tiny model, Ray, FSDP2 over gloo, the real sandbox.

Two runs carry every case, to keep the module within a few minutes on 2 cores.

1. ``chain``: one run directory, interrupted again and again. Every attempt starts from the same
   config file (in-process `train`, or the `verl-agent train` command) and injects its fault one
   step after the checkpoint it resumed from (trainer.save_freq=1):
     kill -9 a train worker during the rollout of step 2 / the update of step 3 / the checkpoint
     write of step 4; kill -9 the driver process after step 4; truncate a file of its newest
     checkpoint and restart it with the same command: it falls back to checkpoint 3, says so, and
     goes on until the disk (the run directory is a small tmpfs) fills during step 5's checkpoint;
     free the space, and the last attempt resumes from checkpoint 4 and finishes.
   Every stop but the killed driver's is a TrainingError (the command: exit status 1 and the same
   message) naming the step, the cause and the last complete checkpoint, raised within DETECT_S of a
   worker's death; the killed driver leaves its newest checkpoint intact; no half-written checkpoint
   is ever "latest"; and
   every metrics line of the run equals the uninterrupted reference run's exactly (same seed, CPU),
   except wall-clock times, engine counters and the engine-vs-actor log-prob gap (fault_helpers.NONDETERMINISTIC).
2. One run whose faults stay inside trajectories, 64 at once: a code tool (the calculator, run in
   the sandbox) hangs past tool_timeout on 30 % of its calls, the sandbox server is killed while
   the tool is in use and restarted, the reward function raises on some samples, engine requests
   raise. The run goes on; every failure is counted under its cause and kept out of the loss.

The faults come from outside (SIGKILL from a watcher thread that sees the worker's Ray process
title, a filler file, a truncated file) or through the run's own extension points (tool class,
reward function, model.external_lib), never from hooks in the trainer.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from fault_helpers import (
    REPO,
    Fault,
    SandboxServer,
    StepClock,
    deterministic,
    fill_disk,
    kill9,
    latest_file,
    latest_step,
    metric_lines,
    report,
    worker_in,
)

from verl_agent.config import load_config, save_config
from verl_agent.trainer.persistence import checkpoint as ckpt
from verl_agent.trainer.loop import TrainingError, train

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
STEPS = 5
# From a train worker's SIGKILL to the TrainingError: Ray reports the actor's death to the driver's
# pending call at once; the driver then waits at most 10 s for the other ranks' answers (to name the
# rank that died first, controller._failure) and kills the group. 10 s covers that whole path with the
# peers answering at once (their collectives fail on the closed socket), as they do in these cases.
DETECT_S = 10.0


def cannot_set_up(reason: str) -> None:
    """A fault that cannot be set up here: a skip on a developer machine, a failure in CI (a skip there is a hole)."""
    if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
        pytest.fail(f"CI=true and the fault cannot be set up: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def cluster():
    """A Ray cluster of this module's own (2 CPUs, its own session dir); its workers can import this folder
    (model.external_lib). A connection this process already holds (another module's cluster) is closed for
    the module and made again after it, if that cluster still runs (a local instance this process started
    ends with its connection)."""
    import ray
    from ray.cluster_utils import Cluster

    previous = None
    if ray.is_initialized():
        ctx = ray.get_runtime_context()
        previous = (ctx.gcs_address, ctx.runtime_env)
        ray.shutdown()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    tmp = tempfile.mkdtemp(prefix="ray-faults-", dir="/tmp")  # short: Unix socket paths are limited to 107 bytes
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False, "temp_dir": tmp})
    path = os.pathsep.join([str(HERE)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    ray.init(address=c.address, namespace="tests-faults",
             runtime_env={"env_vars": {"TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": path}})
    yield c.address
    ray.shutdown()
    c.shutdown()
    shutil.rmtree(tmp, ignore_errors=True)
    if previous is not None and _reachable(previous[0]):
        ray.init(address=previous[0], runtime_env=dict(previous[1]) or None)


def _reachable(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def calc(tmp_path_factory, tiny_model_path):
    from verl_agent.models.calculator_task import CALCULATOR_TOOL_SCHEMA, write_calculator_data

    d = tmp_path_factory.mktemp("calc")
    train_file, _ = write_calculator_data(d, n_train=256, n_test=32, seed=0)
    tools = d / "tools.yaml"
    tools.write_text(yaml.safe_dump({"tools": [{"class_name": "verl_agent.tools.calculator.CalculatorTool",
                                                "config": {}, "tool_schema": CALCULATOR_TOOL_SCHEMA}]}))
    return {"train": train_file, "tools": tools, "model": tiny_model_path, "schema": CALCULATOR_TOOL_SCHEMA}


def base_overrides(calc: dict, run_dir: Path) -> list[str]:
    return [f"data.train_files=[{calc['train']}]", "data.val_files=[]", "data.max_response_length=48",
            "data.reward_fn=verl_agent.models.calculator_task.calculator_reward",
            f"actor_rollout_ref.model.path={calc['model']}", f"trainer.default_local_dir={run_dir}",
            "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3", "actor_rollout_ref.actor.optim.lr=1e-3",
            "trainer.num_cpu_workers=2", "trainer.logger=[console]", "trainer.val_before_train=false"]


# -- 1. the interrupted run --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run_disk(tmp_path_factory):
    """A 64 MiB tmpfs for the chain's run directory (so its disk can be filled), or a plain dir and the reason."""
    mnt = tmp_path_factory.mktemp("run_disk")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        yield mnt, f"mounting a tmpfs is impossible here ({r.stderr.strip() or 'exit ' + str(r.returncode)})"
        return
    yield mnt, None
    if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


@dataclass
class Attempt:
    error: str | None  # the TrainingError's message (in-process) or the command's output (CLI)
    seconds: float
    fault_at: float | None  # monotonic time the fault was injected
    ended: float
    first_step: float | None  # seconds from the start to the first step it completed (None: none)
    resumed_from: int | None = None
    returncode: int | None = None  # the command's exit status (CLI attempts)

    @property
    def detect(self) -> float | None:
        return None if self.fault_at is None else self.ended - self.fault_at


class Chain:
    """The interrupted run: one config file, one run directory, attempts one after another."""

    def __init__(self, calc: dict, cluster_address: str, run_root: Path, mount_problem: str | None, tmp: Path):
        self.run, self.mount, self.mount_problem = run_root / "run", run_root, mount_problem
        self.cfg_path = tmp / "chain.yaml"
        cfg = load_config(None, base_overrides(calc, self.run) + [
            "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            f"trainer.total_training_steps={STEPS}", "trainer.save_freq=1", f"trainer.ray_address={cluster_address}"])
        save_config(cfg, self.cfg_path)
        self.log = tmp / "cli.log"
        self.pending: tuple[str, str, float | None] | None = None  # the last fault, waiting for its recovery time
        self.last: Attempt | None = None
        self.messages: list[str] = []  # every stop's message, written next to the config for a person to read

    def here(self, fault: Fault | None = None) -> Attempt:
        """`train(load_config(chain.yaml))` in this process."""
        err, resumed = None, None
        with StepClock(self.run) as clock, (fault or contextlib.nullcontext()):
            t0 = time.monotonic()
            try:
                resumed = train(load_config(self.cfg_path)).resumed_from
            except TrainingError as e:
                err = str(e)
            t1 = time.monotonic()
        return Attempt(err, t1 - t0, fault.at if fault else None, t1, clock.first(), resumed_from=resumed)

    def command(self, make_fault=None) -> Attempt:
        """`python -m verl_agent train chain.yaml` as a subprocess (a driver that can be killed)."""
        start = self.log.stat().st_size if self.log.exists() else 0
        with StepClock(self.run) as clock, open(self.log, "ab") as out:
            t0 = time.monotonic()
            proc = subprocess.Popen([sys.executable, "-m", "verl_agent", "train", str(self.cfg_path)], cwd=REPO,
                                    stdout=out, stderr=subprocess.STDOUT)
            fault = make_fault(proc) if make_fault else None
            with fault or contextlib.nullcontext():
                try:
                    rc = proc.wait(300)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    raise
                t1 = time.monotonic()
        with open(self.log, "rb") as f:
            f.seek(start)
            text = f.read().decode(errors="replace")
        return Attempt(text if rc else None, t1 - t0, fault.at if fault else None, t1, clock.first(), returncode=rc)

    def assert_intact(self, latest: int) -> None:
        """The newest complete checkpoint is `latest`; "latest" names it; nothing half-written is left or promoted."""
        root = self.run / ckpt.CKPT_DIR
        path, skipped = ckpt.find_latest(self.run)
        assert path is not None and path.name == f"global_step_{latest}" and not skipped, (path, skipped)
        assert latest_file(self.run) == latest
        assert not list(root.glob("*.tmp")), "a partial checkpoint was left behind"
        for p in root.glob("global_step_*"):
            assert ckpt.verify(p) is None, (p, ckpt.verify(p))
            assert int(p.name.rsplit("_", 1)[1]) <= latest

    def assert_metrics_match(self, reference: dict[int, dict], steps: int) -> str:
        lines = metric_lines(self.run)
        assert sorted(lines) == list(range(1, steps + 1))
        for step, m in lines.items():
            assert deterministic(m) == deterministic(reference[step]), f"step {step} differs from the reference run"
        return "yes"

    def recovered(self, attempt: Attempt, exact: str) -> None:
        """The previous fault's row: its outcome, detection time, and this (resuming) attempt's time to a step."""
        if self.pending:
            fault, outcome, detect = self.pending
            report(fault, outcome, exact, detect, attempt.first_step)
            self.pending = None

    def failed(self, fault: str, outcome: str, attempt: Attempt) -> None:
        self.pending = (fault, outcome, attempt.detect)
        self.messages.append(f"{fault}: {attempt.seconds:.1f} s, first step after {attempt.first_step} s\n"
                             f"{attempt.error if attempt.returncode is None else attempt.returncode}")
        (self.cfg_path.parent / "messages.txt").write_text("\n\n".join(self.messages))


@pytest.fixture(scope="module")
def chain(cluster, calc, run_disk, tmp_path_factory):
    mount, problem = run_disk
    return Chain(calc, cluster, mount, problem, tmp_path_factory.mktemp("chain"))


@pytest.fixture(scope="module")
def reference(chain, tmp_path_factory) -> dict[int, dict]:
    """The same config, uninterrupted, in another directory: the metrics every resumed step must reproduce."""
    run = tmp_path_factory.mktemp("reference")
    train(load_config(chain.cfg_path, [f"trainer.default_local_dir={run}"]))
    lines = metric_lines(run)
    assert sorted(lines) == list(range(1, STEPS + 1))
    return lines


def kill_worker_in(method: str, after_checkpoint: int, run: Path) -> Fault:
    """SIGKILL one train worker while it executes `method`, in the step after checkpoint `after_checkpoint`."""
    return Fault(method, lambda: latest_file(run) == after_checkpoint and worker_in(method), kill9)


def test_kill_worker_during_rollout(chain, reference):
    attempt = chain.here(kill_worker_in("take", 1, chain.run))
    assert attempt.fault_at is not None and attempt.error is not None
    assert attempt.detect < DETECT_S, f"the dead worker was reported after {attempt.detect:.1f} s"
    assert "training stopped at step 2" in attempt.error and "died during take" in attempt.error
    assert f"last complete checkpoint: {chain.run / ckpt.CKPT_DIR / 'global_step_1'};" in attempt.error
    chain.assert_intact(1)
    chain.assert_metrics_match(reference, 1)
    chain.failed("kill -9 train worker during rollout (step 2)", "TrainingError: step 2, rank died, ckpt 1", attempt)


def test_kill_worker_during_update(chain, reference):
    assert latest_step(chain.run) == 1, "needs the state test_kill_worker_during_rollout leaves"
    attempt = chain.here(kill_worker_in("update", 2, chain.run))
    chain.recovered(attempt, chain.assert_metrics_match(reference, 2))
    assert attempt.fault_at is not None and attempt.error is not None
    assert attempt.detect < DETECT_S, f"the dead worker was reported after {attempt.detect:.1f} s"
    assert "training stopped at step 3" in attempt.error and "died during update" in attempt.error
    assert "global_step_2" in attempt.error
    chain.assert_intact(2)
    chain.failed("kill -9 train worker during update (step 3)", "TrainingError: step 3, rank died, ckpt 2", attempt)


def test_kill_worker_during_checkpoint_write(chain, reference):
    assert latest_step(chain.run) == 2
    tmp = chain.run / ckpt.CKPT_DIR / "global_step_4.tmp"
    attempt = chain.here(Fault("save", lambda: tmp.exists() and worker_in("save_checkpoint"), kill9))
    chain.recovered(attempt, chain.assert_metrics_match(reference, 3))
    assert attempt.fault_at is not None and attempt.error is not None
    assert attempt.detect < DETECT_S, f"the dead worker was reported after {attempt.detect:.1f} s"
    assert "training stopped at step 4" in attempt.error and "writing checkpoint global_step_4 failed" in attempt.error
    assert "died during save_checkpoint" in attempt.error and "global_step_3" in attempt.error
    chain.assert_intact(3)  # the half-written global_step_4 was neither promoted nor left behind
    chain.failed("kill -9 train worker during checkpoint write (step 4)", "TrainingError: step 4, ckpt 3 intact",
                 attempt)


def test_kill_driver_between_steps(chain, reference):
    assert latest_step(chain.run) == 3

    def after_step_4(proc):  # the step's line is logged: the driver is between steps 4 and 5
        return Fault("driver", lambda: 4 in metric_lines(chain.run) and proc.pid, kill9)

    attempt = chain.command(after_step_4)
    chain.recovered(attempt, chain.assert_metrics_match(reference, 4))
    assert attempt.fault_at is not None and attempt.returncode == -9
    chain.assert_intact(4)
    chain.failed("kill -9 driver between steps 4 and 5", "process killed; ckpt 4 intact", attempt)


def test_restart_falls_back_from_a_truncated_checkpoint_and_says_so(chain, reference):
    """The driver's restart (the same command) finds the newest checkpoint truncated: it resumes from the one before.

    With a tmpfs run directory the same attempt then meets a full disk in step 5's checkpoint (next test).
    """
    assert latest_step(chain.run) == 4
    newest = chain.run / ckpt.CKPT_DIR / "global_step_4"
    shard = max(newest.rglob("*.bin"), key=lambda p: p.stat().st_size)
    size = shard.stat().st_size
    os.truncate(shard, size // 2)
    assert ckpt.latest_checkpoint(chain.run).name == "global_step_3"
    fill = None
    if not chain.mount_problem:  # the disk fills while step 5 trains: its checkpoint cannot be written

        def fill(proc):
            return Fault("fill", lambda: latest_step(chain.run) == 4 and worker_in("update"),  # 4 rewritten
                         lambda _: fill_disk(chain.mount, leave_bytes=256 << 10))

    chain.last = attempt = chain.command(fill)
    text = attempt.error or chain.log.read_text(errors="replace")
    assert (f"global_step_4 is not a complete checkpoint: {shard.relative_to(newest)} is {size // 2} bytes, "
            f"{size} when written (truncated or overwritten); resuming from "
            f"{chain.run / ckpt.CKPT_DIR / 'global_step_3'} instead") in text
    chain.recovered(attempt, chain.assert_metrics_match(reference, 4 if fill else STEPS))
    report("truncated shard in the newest checkpoint (step 4)", "falls back to ckpt 3, warns, resumes", "yes", None,
           attempt.first_step)
    if not fill:
        assert attempt.returncode == 0
        chain.assert_intact(STEPS)


def test_disk_full_during_checkpoint_write(chain, reference):
    if chain.mount_problem:
        cannot_set_up(f"disk-full case: {chain.mount_problem}")
    attempt = chain.last
    assert attempt.fault_at is not None and attempt.returncode == 1, attempt.error
    err = attempt.error[attempt.error.rindex("verl-agent: error: training stopped at step"):]  # the command's line
    assert err.startswith("verl-agent: error: training stopped at step 5: writing checkpoint global_step_5 failed "
                          "(the partial one was removed): save_checkpoint raised on worker rank"), err[:300]
    assert "OSError: [Errno 28] No space left on device" in err, err
    assert f"last complete checkpoint: {chain.run / ckpt.CKPT_DIR / 'global_step_4'};" in err
    chain.assert_intact(4)  # the partial global_step_5 was removed, "latest" still names step 4
    (chain.mount / "filler.bin").unlink()  # space is back: the same command finishes the run
    chain.failed("disk full during checkpoint write (step 5)", "exit 1 / TrainingError: ENOSPC, ckpt 4", attempt)
    attempt = chain.here()
    assert attempt.error is None and attempt.resumed_from == 4
    chain.recovered(attempt, chain.assert_metrics_match(reference, STEPS))
    chain.assert_intact(STEPS)


# -- 2. faults inside trajectories -------------------------------------------------------------------------


def _events(log: Path) -> list[dict]:
    """The tool's call log (fault_tools.SandboxCalculator); a line being written is skipped."""
    out = []
    for ln in log.read_text().splitlines() if log.exists() else []:
        with contextlib.suppress(ValueError):
            out.append(json.loads(ln))
    return out


def test_faults_inside_trajectories_are_counted_and_kept_out_of_the_loss(cluster, calc, tmp_path):
    log, sandbox = tmp_path / "tool_calls.jsonl", SandboxServer(tmp_path / "sandbox.log")
    sandbox.start()
    tools = tmp_path / "tools.yaml"
    tools.write_text(yaml.safe_dump({"tools": [{
        "class_name": f"{HERE / 'fault_tools.py'}:SandboxCalculator", "tool_schema": calc["schema"],
        "config": {"sandbox_fusion_url": sandbox.url, "log": str(log), "default_timeout": 5}}]}))
    run = tmp_path / "run"
    cfg = load_config(None, base_overrides(calc, run) + [
        "data.train_batch_size=16", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=16",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}",
        "actor_rollout_ref.rollout.multi_turn.tool_timeout=1", f"data.reward_fn={HERE / 'fault_tools.py'}:reward",
        "actor_rollout_ref.model.external_lib=fault_engine", "trainer.total_training_steps=2",
        "trainer.max_infra_failure_fraction=0.9"])
    count = lambda event: sum(e["event"] == event for e in _events(log))
    restarted: dict[str, float] = {}

    def restart(_):
        restarted["seconds"] = sandbox.start()
        restarted["at"] = time.time()

    kill = Fault("sandbox", lambda: count("call") >= 3, lambda _: sandbox.kill9(), poll=0.02)
    back = Fault("restart", lambda: kill.at and count("unavailable") >= 1, restart, poll=0.02)
    try:
        with kill, back:
            t0 = time.monotonic()
            result = train(cfg)
            seconds = time.monotonic() - t0
    finally:
        sandbox.stop()
    assert kill.at is not None and "at" in restarted, "the sandbox was not killed and restarted mid-rollout"

    assert len(result.history) == 2  # the run went on
    causes_seen = Counter()
    for step, m in enumerate(result.history, start=1):
        records = [json.loads(ln) for ln in (run / "trajectories" / f"step_{step}.jsonl").open()]
        assert len(records) == m["rollout/num_trajectories"] == 64
        failed = [r for r in records if r["outcome"] == "infra_failure"]
        causes = Counter(r["cause"] for r in failed)
        causes_seen.update(causes)
        for cause, n in causes.items():
            assert m[f"rollout/infra_failed/{cause}"] == n, cause
        assert all(r["reward"] == 0.0 and r["error"] for r in failed)  # never turned into reward
        waited = [r["turns"][-1]["tool_seconds"] for r in failed if r["cause"] == "tool_timeout"]
        assert all(1.0 <= w < 3.0 for w in waited), waited  # tool_timeout=1 held under load (2 s of slack)
        assert m["train/excluded_trajectories"] == len(failed)  # ... and kept out of the loss
        assert 0 < m["train/sequences"] <= 64 - len(failed) and math.isfinite(m["actor/pg_loss"])
    assert set(causes_seen) <= {"tool_timeout", "sandbox_unavailable", "reward_error", "engine_error"}, causes_seen
    assert all(causes_seen[c] > 0 for c in ("tool_timeout", "sandbox_unavailable", "reward_error", "engine_error")), \
        causes_seen

    events = _events(log)
    hung = [e["call"] for e in events if e["event"] == "hang"]
    calls = len(hung) + count("call")
    assert hung and sorted(hung) == sorted(e["call"] for e in events if e["event"] == "cancelled")  # none leaked
    assert 0.2 <= len(hung) / calls <= 0.5, (len(hung), calls)  # calls 1, 4, 7 of every 10 on each worker
    assert max(e["max_in_flight"] for e in events) >= 4  # the hung calls did not serialize the others
    assert any(e["event"] == "ok" and e["t"] > restarted["at"] for e in events)  # the tool works again
    report("tool hangs past tool_timeout on 30 % of calls (64 concurrent)",
           f"continues: {causes_seen['tool_timeout']} tool_timeout excluded", "n/a", None, None)
    report("sandbox server killed mid-rollout, restarted",
           f"continues: {causes_seen['sandbox_unavailable']} sandbox_unavailable excluded", "n/a",
           None, restarted["seconds"])
    report("reward function raises on some samples", f"continues: {causes_seen['reward_error']} reward_error excluded",
           "n/a", None, None)
    report("engine request raises", f"continues: {causes_seen['engine_error']} engine_error excluded", "n/a", None,
           None)
    report("(trajectory-fault run: 2 steps x 64 trajectories)", f"{seconds:.0f} s wall", "", None, None)

