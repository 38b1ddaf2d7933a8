"""The README's five-minute tour, run command by command, so it cannot rot.

The commands are read from the README's code block under "## A five-minute tour" and run in
a scratch copy of `examples/` with a few small overrides (one training step, small batches);
the long-running `sandbox serve` is started, pinged over real HTTP, and stopped.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
SMALL = {  # appended to the tour's commands: the same code paths, less work
    "train": ["trainer.total_training_steps=1", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2",
              "actor_rollout_ref.actor.ppo_mini_batch_size=2", "trainer.val_before_train=false", "data.val_files=[]"],
    "rollout": ["data.val_batch_size=16"],
    "eval": ["data.val_files=[examples/calculator/data/tour_val.jsonl]"],  # 2 of the held-out prompts
}


def tour_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## A five-minute tour", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]


def test_tour_is_what_this_test_runs():
    cmds = tour_commands()
    assert [shlex.split(c)[1] for c in cmds] == ["--help", "model", "train", "rollout", "eval", "view", "config",
                                                 "sandbox"]  # fmt: skip


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_readme_tour_runs(tmp_path, tiny_model_path):
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    held_out = (tmp_path / "examples/calculator/data/test.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "examples/calculator/data/tour_val.jsonl").write_text("".join(held_out[:2]))
    exe = str(Path(sys.executable).with_name("verl-agent"))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    for cmd in tour_commands():
        argv = [exe, *shlex.split(cmd)[1:]]
        if argv[1] == "sandbox":
            port = _free_port()
            proc = subprocess.Popen([*argv, "--port", str(port)], cwd=tmp_path, env=env, start_new_session=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            try:
                deadline = time.monotonic() + 60
                while True:
                    try:
                        if httpx.get(f"http://127.0.0.1:{port}/v1/ping", timeout=2).status_code == 200:
                            break
                    except httpx.HTTPError:
                        pass
                    assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()[-2000:]
                    time.sleep(0.5)
                ran = httpx.post(f"http://127.0.0.1:{port}/run_code", json={"code": "print(6 * 7)",
                                                                              "language": "python"}, timeout=30)
                assert ran.json()["run_result"]["stdout"].strip() == "42"
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGTERM)
                    proc.wait(timeout=30)
            continue
        argv += SMALL.get(argv[1], [])
        out = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, f"{cmd}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"
        if argv[1] == "view":
            assert out.stdout.count("== ") == 2 and "assistant:" in out.stdout
        if argv[1] == "rollout":
            assert '"split": "val"' in out.stdout
        if argv[1] == "eval":  # one column per model: the base model and the run's checkpoint
            assert out.stdout.split("\n", 1)[0].split()[2:] == ["tiny", "runs/verl_agent/calculator"]
            assert "pass@4" in out.stdout and (tmp_path / "runs/verl_agent/calculator/eval/result.json").is_file()
    run = tmp_path / "runs" / "verl_agent" / "calculator"
    assert (run / "trajectories" / "step_1.jsonl").is_file() and (run / "hf_model" / "config.json").is_file()
