"""The compiled decode step's cache (compile_cache.py): a second engine start, in a fresh process, loads what
the first compiled instead of compiling it again (CPU: inductor's C++ kernels)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from verl_agent.engine.runner.compile_cache import compile_key

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import asyncio, json
from model_helpers import random_qwen2
from torch._dynamo.utils import counters
from verl_agent.engine.contract import SamplingParams
from verl_agent.engine.backends.hf_engine import HFEngine

async def main():
    e = HFEngine(random_qwen2(seed=5, layers=1), stop_on_eos=False, max_model_len=64, torch_compile=True)
    out = await e.generate([5, 6, 7], SamplingParams(temperature=1.0, max_new_tokens=3, seed=1))
    loaded = e.metrics()["engine/compile_cache_loaded"]
    await e.close()
    print(json.dumps({"tokens": out.token_ids, "logprobs": out.logprobs, "loaded": loaded,
                      "hit": counters["inductor"]["fxgraph_cache_hit"],
                      "miss": counters["inductor"]["fxgraph_cache_miss"]}))

asyncio.run(main())
"""


def start_engine(cache: Path, inductor: Path | None) -> dict:
    """One engine start in a fresh Python. `inductor`: torch's own on-disk cache, empty, so that a hit can
    only come from our cache file (None: torch's default one, which earlier test runs on this machine warm)."""
    env = {**os.environ, "VERL_AGENT_CACHE": str(cache),
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}  # fmt: skip
    if inductor is not None:
        env["TORCHINDUCTOR_CACHE_DIR"] = str(inductor)
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_a_second_engine_start_reuses_the_compiled_decode_step(tmp_path):
    """The first start finds no file of ours, compiles (or takes torch's machine-wide cache) and writes one;
    the second, with torch's own cache empty, loads our file and compiles nothing: every Inductor graph is
    a cache hit, and it samples what the first sampled."""
    first = start_engine(tmp_path / "cache", None)
    assert first["loaded"] == 0
    files = list((tmp_path / "cache" / "compile").iterdir())
    assert len(files) == 1 and files[0].suffix == ".bin" and files[0].stat().st_size > 0
    second = start_engine(tmp_path / "cache", tmp_path / "inductor")
    assert second["loaded"] >= 1 and second["hit"] >= 1 and second["miss"] == 0
    assert second["tokens"] == first["tokens"] and second["logprobs"] == first["logprobs"]


def test_the_cache_key_follows_the_shape_and_dtype():
    from transformers import Qwen2Config

    cfg = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=96)  # fmt: skip
    cpu = torch.device("cpu")
    key = compile_key(cfg, torch.float32, cpu)
    assert key == compile_key(Qwen2Config(**cfg.to_dict()), torch.float32, cpu)
    assert key != compile_key(cfg, torch.bfloat16, cpu)
    cfg.num_hidden_layers = 3
    assert key != compile_key(cfg, torch.float32, cpu)
