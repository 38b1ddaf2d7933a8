"""Where a decode step's time goes: the hf engine's decode on a saved model, timed, then under torch.profiler.

  python bench/decode_profile.py --model-dir /dev/shm/qwen2-7b --rows 64      # a model bench/grpo_step.py wrote

Runs `rows` requests of `--prompt` random tokens and `--new` new tokens twice (the first warms up: graphs,
compiles), reports decode ms per step with its roofline share, then profiles one more round and prints the
top kernels by GPU time, and the share of matrix products, attention and the rest. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from roofline import roofline, roofline_line

KINDS = (("gemm", ("gemm", "gemv", "sm90_xmma", "cutlass", "nvjet", "splitk")), ("attention", ("flash", "fmha", "attention", "sdpa")))


async def one_round(engine, rows: int, prompt: int, new: int, vocab: int, seed: int) -> tuple[float, float]:
    from verl_agent.engine.contract import SamplingParams

    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(prompt)] for _ in range(rows)]
    sp = SamplingParams(temperature=1.0, top_k=0, max_new_tokens=new, seed=seed)
    m0 = engine.metrics()
    await asyncio.gather(*(engine.generate(p, sp) for p in prompts))
    m1 = engine.metrics()
    steps = m1["engine/decode_steps"] - m0["engine/decode_steps"]
    return 1e3 * (m1["engine/decode_s"] - m0["engine/decode_s"]) / steps, (m1["engine/decode_rows"] - m0["engine/decode_rows"]) / steps


def kernel_table(prof, top: int) -> tuple[list[tuple[str, float]], dict[str, float], float]:
    times: dict[str, float] = {}
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", 0.0) or getattr(e, "self_cuda_time_total", 0.0)
        if t > 0 and e.device_type == torch.autograd.DeviceType.CUDA:
            times[e.key] = times.get(e.key, 0.0) + t
    total = sum(times.values()) or 1.0
    kinds = {k: 0.0 for k, _ in KINDS} | {"other": 0.0}
    for name, t in times.items():
        kind = next((k for k, words in KINDS if any(w in name.lower() for w in words)), "other")
        kinds[kind] += t / total
    ranked = sorted(times.items(), key=lambda kv: -kv[1])[:top]
    return [(n[:110], t / total) for n, t in ranked], kinds, total


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, required=True)
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--prompt", type=int, default=173)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--compile", action="store_true", help="rollout.enable_torch_compile=true (default: the engine's "
                   "default, compiled where its own decode step runs)")
    p.add_argument("--eager", action="store_true", help="rollout.enable_torch_compile=false")
    p.add_argument("--no-lookahead", action="store_true", help="decode one step at a time (decode_lookahead=False)")
    p.add_argument("--top", type=int, default=15)
    a = p.parse_args()
    from transformers import AutoConfig

    from verl_agent.engine.backends.hf_engine import HFEngine

    cfg = AutoConfig.from_pretrained(a.model_dir)
    engine = HFEngine(str(a.model_dir), device="cuda", dtype="bfloat16", stop_on_eos=False, max_num_seqs=a.rows,
                      max_model_len=a.prompt + a.new, torch_compile=True if a.compile else False if a.eager else None,
                      gpu_memory_utilization=0.9, decode_lookahead=not a.no_lookahead)
    t0 = time.perf_counter()
    await one_round(engine, a.rows, a.prompt, a.new, cfg.vocab_size, 0)
    first_s = time.perf_counter() - t0
    ms, rows = await one_round(engine, a.rows, a.prompt, a.new, cfg.vocab_size, 1)
    m0, t1 = engine.metrics(), time.perf_counter()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        await one_round(engine, a.rows, a.prompt, a.new, cfg.vocab_size, 2)
    wall_s, steps = time.perf_counter() - t1, engine.metrics()["engine/decode_steps"] - m0["engine/decode_steps"]
    shape = {k: getattr(cfg, k) for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                           "num_attention_heads", "num_key_value_heads", "vocab_size",
                                           "tie_word_embeddings")}  # fmt: skip
    roof = roofline(shape, torch.cuda.get_device_name(), decode_ms=ms, rows=rows, mean_context=a.prompt + a.new / 2)
    top, kinds, gpu_us = kernel_table(prof, a.top)
    busy = {"gpu_ms_per_step": gpu_us / 1e3 / steps, "wall_ms_per_step": 1e3 * wall_s / steps}
    print(f"first round (warm-up incl. captures/compiles) {first_s:.1f} s; {roofline_line(roof)}")
    print(f"profiled round: {busy['wall_ms_per_step']:.2f} ms a decode step of wall time (prefill and host work "
          f"included), {busy['gpu_ms_per_step']:.2f} ms of it running kernels")
    print("GPU time by kind: " + ", ".join(f"{k} {100 * v:.0f} %" for k, v in kinds.items()))
    for name, share in top:
        print(f"{100 * share:5.1f} %  {name}")
    print(json.dumps({"bench": "decode_profile", "model": str(a.model_dir), "compile": "eager" if a.eager else "on" if a.compile else "default", "lookahead": not a.no_lookahead, "first_round_s": first_s,
                      "roofline": roof, "kinds": kinds, "top": top, **busy, "metrics": engine.metrics()}))
    await engine.close()


if __name__ == "__main__":
    asyncio.run(main())
