"""Rollout benchmarks: agent-loop overhead and hf-engine throughput. Prints a table and one JSON line.

  python bench/rollout.py                 # loop overhead (instant engine) + hf engine on CPU with the tiny model
  python bench/rollout.py --gpu           # + the GPU fast path on a random Qwen2-0.5B-shaped model (bf16)
  python bench/rollout.py --gpu --only-gpu --batch 256 --prompt-len 256 --new-tokens 256
  python bench/rollout.py --only-gpu --gpu-rows continuous --batch 128 --new-tokens 128 --seeded   # as the trainer samples
  python bench/rollout.py --only-gpu --gpu-shape 7b --batch 64 --prompt-len 185 --gpu-rows continuous,compiled
  python bench/rollout.py --only-gpu --gpu-shape 7b --batch 64 --prompt-len 185 --gpu-rows continuous,unfused

Loop overhead: 2-turn calculator conversations on a scripted engine that answers
instantly, so the figure is the cost of the loop itself (parsing, tools, chat
encoding, bookkeeping) on one asyncio thread = one core.
Engine throughput: N concurrent requests of equal length through the Engine API
(the hf engine, and the per-batch baseline of bench/baselines.py) vs transformers'
own `generate` on the same batch (warm calls; generated tokens/s).
Needs neither ray nor sglang.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def bench_loop(n_traj: int) -> dict[str, float]:
    from verl_agent.config import RolloutConfig
    from verl_agent.models.tokenizer import train_tokenizer
    from verl_agent.protocol import Message, Sample
    from verl_agent.rollout.agent_loop import AgentLoop
    from verl_agent.engine.contract import SamplingParams
    from verl_agent.engine.backends.scripted import ScriptedEngine
    from verl_agent.tools import CalculatorTool

    tok = train_tokenizer(["What is 12 * 37? The answer is 444. calculator expression arguments name"] * 50, 400)
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*37"}}\n</tool_call>'

    def script(ids: list[int], _sp: SamplingParams) -> str:
        return call if tok.decode(ids).count("<|im_start|>assistant") == 1 else "The answer is 444."

    engine = ScriptedEngine(tok, script, eos_id=tok.convert_tokens_to_ids("<|im_end|>"))
    loop = AgentLoop(engine, tok, RolloutConfig(), tools={"calculator": CalculatorTool()}, max_response_length=512)
    samples = [Sample(uid=str(i), messages=[Message(role="user", content="What is 12 * 37?")]) for i in range(n_traj)]
    asyncio.run(loop.run(samples[:8], 1, SamplingParams()))  # warm-up
    t0 = time.perf_counter()
    batch = asyncio.run(loop.run(samples, 1, SamplingParams()))
    dt = time.perf_counter() - t0
    turns = sum(len(t.turns) for t in batch.trajectories)
    assert all(t.stop_reason == "end_of_turn" for t in batch.trajectories), batch.trajectories[0]
    return {"loop_turns_per_s": turns / dt, "loop_ms_per_turn": 1000 * dt / turns, "loop_trajectories": n_traj}


def _raw_generate(model, batch: int, plen: int, new: int, static: bool) -> float:
    ids = torch.randint(3, model.config.vocab_size - 1, (batch, plen), device=model.device)
    kw = {"cache_implementation": "static"} if static else {}
    for _ in range(2):  # the second (warm) call is timed
        sync(model.device)
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=0, max_new_tokens=new,
                       min_new_tokens=new, pad_token_id=0, **kw)  # fmt: skip
        sync(model.device)
        dt = time.perf_counter() - t0
    return batch * new / dt


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _engine_throughput(model, batch: int, plen: int, new: int, device: str, repeats: int = 2,
                       per_batch: bool = False, torch_compile: bool = False, stats: dict | None = None,
                       seeded: bool = False, fused_norms: bool = True, own_decode_step: bool = True) -> float:
    """Best generated tokens/s of `repeats` warm calls; `stats` gets the first call's seconds (graph captures,
    compiles) and the warm calls' milliseconds per decode step. per_batch: the baseline, not the hf engine."""
    from baselines import PerBatchEngine

    from verl_agent.engine.contract import SamplingParams
    from verl_agent.engine.backends.hf_engine import HFEngine

    if per_batch:
        engine = PerBatchEngine(model, device=device, max_batch_size=batch, stop_on_eos=False)
    else:
        engine = HFEngine(model, device=device, max_num_seqs=batch, stop_on_eos=False, max_model_len=plen + new,
                          gpu_memory_utilization=0.85, torch_compile=torch_compile,
                          fused_norms=fused_norms, own_decode_step=own_decode_step)  # fmt: skip
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab - 1, (plen,), generator=gen).tolist() for _ in range(batch)]
    sp = [SamplingParams(temperature=1.0, max_new_tokens=new, seed=i if seeded else None) for i in range(batch)]

    async def once() -> float:
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(engine.generate(p, q) for p, q in zip(prompts, sp)))
        dt = time.perf_counter() - t0
        assert all(len(o.token_ids) == new for o in outs)
        return batch * new / dt

    async def run() -> float:
        t0 = time.perf_counter()
        if not (torch_compile or per_batch):  # on CUDA: every decode bucket before timing (compiled: those used)
            await engine.capture_graphs()
        best = 0.0
        for i in range(repeats + 1):  # the first call warms up (and compiles on GPU)
            if i == 1:
                first_s, m0 = time.perf_counter() - t0, engine.metrics()
            tps = await once()
            best = max(best, tps) if i > 0 else best
        m1 = engine.metrics()
        if stats is not None and m1.get("engine/decode_steps"):
            steps = m1["engine/decode_steps"] - m0["engine/decode_steps"]
            decode_s = m1["engine/decode_s"] - m0["engine/decode_s"]
            stats.update(first_call_s=first_s, decode_step_ms=1e3 * decode_s / steps,
                         graph_captures=m0.get("engine/graph_captures", 0.0),
                         graph_capture_s=m0.get("engine/graph_capture_s", 0.0))
            if torch_compile:  # where the compile time went: dynamo's timed phases, summed over graphs (seconds)
                from torch._dynamo.utils import compilation_time_metrics

                stats.update({f"compile_{k}": sum(v) for k, v in compilation_time_metrics.items() if sum(v) > 0.5})
        await engine.close()
        return best

    return asyncio.run(run())


def bench_cpu(batch: int, plen: int, new: int) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    from verl_agent.models.tiny import build_tiny

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(build_tiny())).eval()
    return {
        "cpu_engine_tok_s": _engine_throughput(model, batch, plen, new, "cpu"),
        "cpu_engine_batch_sched_tok_s": _engine_throughput(model, batch, plen, new, "cpu", per_batch=True),
        "cpu_generate_tok_s": _raw_generate(model, batch, plen, new, static=False),
    }


def bench_gpu(batch: int, plen: int, new: int, rows: str = "generate,continuous,batch", shape: str = "0.5b",
              seeded: bool = False) -> dict[str, float]:  # fmt: skip
    from grpo_step import SHAPES
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(**SHAPES[shape], max_position_embeddings=32768, eos_token_id=151643)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    res: dict[str, float | str] = {"gpu_name": torch.cuda.get_device_name(), "shape": shape}
    eager, compiled, unfused, theirs = {}, {}, {}, {}
    runs = {"generate": ("gpu_generate_static_tok_s", lambda: _raw_generate(model, batch, plen, new, static=True)),
            "continuous": ("gpu_engine_tok_s",
                           lambda: _engine_throughput(model, batch, plen, new, "cuda", stats=eager, seeded=seeded)),
            "compiled": ("gpu_engine_compiled_tok_s", lambda: _engine_throughput(
                model, batch, plen, new, "cuda", torch_compile=True, stats=compiled)),
            "compiled_transformers": ("gpu_engine_compiled_transformers_tok_s", lambda: _engine_throughput(
                model, batch, plen, new, "cuda", torch_compile=True, stats=theirs, own_decode_step=False)),
            "unfused": ("gpu_engine_unfused_norms_tok_s", lambda: _engine_throughput(
                model, batch, plen, new, "cuda", stats=unfused, seeded=seeded, fused_norms=False)),
            "batch": ("gpu_engine_batch_sched_tok_s",
                      lambda: _engine_throughput(model, batch, plen, new, "cuda", per_batch=True))}
    for row in rows.split(","):
        key, fn = runs[row]
        res[key] = fn()
        print(f"# {key}: {res[key]:,.0f}", file=sys.stderr, flush=True)  # progress, in case a time limit cuts the run
    res.update({f"gpu_engine_{k}": v for k, v in eager.items()})
    res.update({f"gpu_engine_compiled_{k}": v for k, v in compiled.items()})
    res.update({f"gpu_engine_unfused_norms_{k}": v for k, v in unfused.items()})
    res.update({f"gpu_engine_compiled_transformers_{k}": v for k, v in theirs.items()})
    if "gpu_engine_tok_s" in res and "gpu_generate_static_tok_s" in res:
        res["gpu_engine_vs_generate"] = res["gpu_engine_tok_s"] / res["gpu_generate_static_tok_s"]
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", action="store_true", help="also run the GPU benchmark (Qwen2-0.5B shape, bf16)")
    p.add_argument("--only-gpu", action="store_true")
    p.add_argument("--batch", type=int, default=256, help="GPU: concurrent requests")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--trajectories", type=int, default=256, help="loop benchmark: trajectories")
    p.add_argument("--gpu-rows", default="generate,continuous,batch",
                   help="GPU rows: raw static generate, the hf engine ('continuous'), the per-batch baseline "
                   "('batch'), 'compiled' (the hf engine with torch_compile), 'compiled_transformers' (the same through "
                   "transformers' forward, own_decode_step=False) and 'unfused' (the hf engine with the model's own "
                   "RMSNorm forward, fused_norms=False)")
    p.add_argument("--gpu-shape", choices=["0.5b", "7b"], default="0.5b", help="GPU: Qwen2 shape (random weights)")
    p.add_argument("--seeded", action="store_true", help="GPU continuous row: every request seeded, as the trainer "
                   "seeds them (each seeded row draws its own random numbers)")
    args = p.parse_args()
    res: dict[str, float | str] = {}
    if not args.only_gpu:
        res.update(bench_loop(args.trajectories))
        res.update(bench_cpu(batch=32, plen=64, new=64))
    if args.gpu or args.only_gpu:
        res.update(bench_gpu(args.batch, args.prompt_len, args.new_tokens, args.gpu_rows, args.gpu_shape, args.seeded))
    width = max(len(k) for k in res)
    print(f"{'metric':<{width}}  value")
    for k, v in res.items():
        print(f"{k:<{width}}  {v:,.3f}" if isinstance(v, float) else f"{k:<{width}}  {v}")
    print(json.dumps({"bench": "rollout", **res}))


if __name__ == "__main__":
    main()
