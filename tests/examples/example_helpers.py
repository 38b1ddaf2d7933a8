"""Shared helpers of the example tests: load an example's config with absolute paths, run it, script a model.

The examples' configs use paths relative to the repository root (where users run the
one command); tests resolve them so they pass from any working directory.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx

from verl_agent.config import RunConfig, load_config
from verl_agent.data import load_samples
from verl_agent.protocol import RolloutBatch, Sample
from verl_agent.engine.contract import SamplingParams
from verl_agent.rollout.build import build_agent_loop, build_reward
from verl_agent.engine.backends.scripted import ScriptedEngine

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
NAMES = ["code_interpreter", "feedback_interaction", "gym_text_game", "custom_tool", "search_agent"]


def _abs(path: str) -> str:
    return path if Path(path).is_absolute() else str(REPO / path)


def example_config(name: str, *overrides: str, model_path: Path | str | None = None) -> RunConfig:
    """examples/<name>/config.yaml with repo-relative paths made absolute, then `overrides` (they win)."""
    cfg = load_config(EXAMPLES / name / "config.yaml")
    d, mt = cfg.data, cfg.actor_rollout_ref.rollout.multi_turn
    fixed = [f"data.train_files=[{','.join(map(_abs, d.train_files))}]",
             f"data.val_files=[{','.join(map(_abs, d.val_files))}]", "trainer.device=cpu"]
    if d.reward_fn and ".py:" in d.reward_fn:
        fixed.append(f"data.reward_fn={_abs(d.reward_fn)}")
    for key in ("tool_config_path", "interaction_config_path"):
        if getattr(mt, key):
            fixed.append(f"actor_rollout_ref.rollout.multi_turn.{key}={_abs(getattr(mt, key))}")
    if model_path is not None:
        fixed.append(f"actor_rollout_ref.model.path={model_path}")
    return load_config(EXAMPLES / name / "config.yaml", fixed + list(overrides))


def val_samples(cfg: RunConfig, k: int) -> list[Sample]:
    return load_samples(cfg.data.val_files[0])[:k]


async def rollout(cfg: RunConfig, engine: Any, tokenizer: Any, samples: list[Sample], n: int = 1,
                  sampling: SamplingParams | None = None) -> tuple[RolloutBatch, Any]:
    """Run the example's agent loop (its tools, interactions and reward) on `engine`; returns (batch, loop)."""
    r = cfg.actor_rollout_ref.rollout
    reward = build_reward(cfg.data, cfg.custom_reward_function, cfg.reward_model)
    loop = build_agent_loop(r, cfg.data, engine, tokenizer, reward)
    sampling = sampling or SamplingParams(temperature=1.0, max_new_tokens=256, seed=0)
    return await loop.run(samples, n, sampling), loop


def tool_call(name: str, args: str) -> str:
    """The assistant text of one tool call in the tiny model's (Qwen/hermes) format."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def scripted_engine(tok: Any, replies: Any) -> ScriptedEngine:
    """Reply replies[k] on the k-th assistant turn (last repeats); a callable gets (prompt_text, k)."""

    def script(ids: list[int], _sp: Any) -> str:
        text = tok.decode(ids)
        k = text.count("<|im_start|>assistant") - 1
        return replies(text, k) if callable(replies) else replies[min(k, len(replies) - 1)]

    return ScriptedEngine(tok, script, eos_id=tok.convert_tokens_to_ids("<|im_end|>"))


def load_module(path: Path) -> ModuleType:
    """Import an example's script by file path (examples are not packages)."""
    spec = importlib.util.spec_from_file_location(f"example_{path.parent.name}_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def assert_data_reproducible(name: str, tmp_path: Path) -> None:
    """The folder's make_data.py regenerates the shipped data byte for byte."""
    load_module(EXAMPLES / name / "make_data.py").main(["--out", str(tmp_path)])
    shipped = sorted(p.name for p in (EXAMPLES / name / "data").glob("*.jsonl"))
    assert shipped == sorted(p.name for p in tmp_path.glob("*.jsonl"))
    for fname in shipped:
        assert (tmp_path / fname).read_bytes() == (EXAMPLES / name / "data" / fname).read_bytes(), fname


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SandboxProcess:
    """`verl-agent sandbox serve --backend B` (its module entry point) on a free loopback port; killed on exit."""

    def __init__(self, backend: str = "process", pool_size: int = 2):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "verl_agent.sandbox.cli", "serve", "--backend", backend,
                    "--port", str(self.port), "--pool-size", str(pool_size), "--log-level", "warning"]
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> SandboxProcess:
        self.proc = subprocess.Popen(self.cmd, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sandbox server exited with {self.proc.returncode}: {' '.join(self.cmd)}")
            try:
                if httpx.get(f"{self.url}/v1/ping", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.__exit__()
        raise RuntimeError(f"sandbox server did not answer on {self.url} within 90 s")

    def __exit__(self, *exc: Any) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def tools_yaml_with_url(tmp_path: Path, url: str) -> Path:
    """A copy of the code_interpreter tools.yaml pointing at `url`."""
    text = (EXAMPLES / "code_interpreter" / "tools.yaml").read_text()
    out = tmp_path / "tools.yaml"
    out.write_text(text.replace("http://127.0.0.1:8080", url))
    assert url in out.read_text()
    return out
