"""The actor update alone, padded rows vs shared prefixes, side by side in one process. Prints a table and one JSON line.

  python3 bench/update.py --shape 7b --model-dir /dev/shm --profile     # one GPU: the GRPO bench's update
  python3 bench/update.py --shape tiny --device cpu --steps 1           # CPU: the mechanics

The workload is bench/grpo_step.py's update: 8 prompts x 8 samples, each a 185-token prompt (128 letters and
the chat template) and 256 response tokens, on-policy (one mini-batch, one epoch: the update's own forward
gives the old log-probs), random advantages. It runs through `Policy.update`, the trainer's own code, with
the trainer's settings for the shape (gradient checkpointing; 7b: bf16 parameters and moments, as in
grpo_step's documented 7B command; the micro-batch budget from the memory planner unless --set gives one).

Variants alternate (padded, shared, padded, shared, ...) after one warm-up update each, so drift hits both.
MFU = 6 x parameters x tokens the forward ran / seconds / the card's dense bf16 peak; the shared variant runs
fewer tokens for the same update, so its "padded-equivalent MFU" (same numerator as padded) is given too.
--profile: one more update of each variant under the torch profiler; the table splits its GPU time into
matmuls, attention, the optimizer, communication and copies, and the rest (elementwise, norms, ...).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from grpo_step import SHAPES, build_model_dir  # noqa: E402 - bench/ is the script's dir
from roofline import device_peaks, n_params  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
KERNEL_KINDS = (  # first match wins; names of cuBLAS/CUTLASS, SDPA, fused AdamW, NCCL and copy kernels
    ("matmul", ("gemm", "cutlass", "nvjet", "xmma", "cublas")),
    ("attention", ("fmha", "flash", "attention", "efficient")),
    ("optimizer", ("adam",)),
    ("comm+copy", ("nccl", "memcpy", "memset", "copy")),
)


def make_seqs(prompts: int, gens: int, prompt_len: int, response_len: int, vocab: int, seed: int = 0) -> list:
    from verl_agent.trainer.policy.batch import TrainSeq

    g = torch.Generator().manual_seed(seed)
    seqs = []
    for p in range(prompts):
        prompt = torch.randint(300, vocab, (prompt_len,), generator=g).tolist()
        for _ in range(gens):
            response = torch.randint(300, vocab, (response_len,), generator=g).tolist()
            seqs.append(TrainSeq(input_ids=prompt + response, prompt_len=prompt_len, uid=f"p{p}",
                                 loss_mask=torch.ones(response_len), advantages=torch.randn(response_len, generator=g),
                                 rollout_log_probs=torch.zeros(response_len)))
    return seqs


def build_policy(args, model_path: str):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from verl_agent.config import load_config
    from verl_agent.trainer.policy.policy import Policy

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=0, world_size=1)
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    if args.device == "cuda":
        torch.cuda.set_device(device)
    big = args.shape in ("7b", "14b", "32b")
    cfg = load_config(None, [
        f"actor_rollout_ref.model.path={model_path}",
        f"actor_rollout_ref.model.dtype={'bfloat16' if big else 'float32'}",
        "actor_rollout_ref.model.enable_gradient_checkpointing=true", "actor_rollout_ref.rollout.dtype=bfloat16",
        f"actor_rollout_ref.rollout.n={args.gens}", f"data.train_batch_size={args.prompts}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}", "actor_rollout_ref.actor.optim.lr=1e-6",
        f"data.max_prompt_length={args.prompt_len}", f"data.max_response_length={args.response_len}",
        "actor_rollout_ref.rollout.free_cache_engine=true", f"trainer.n_gpus_per_node={int(args.device == 'cuda')}",
    ] + args.set)  # fmt: skip
    return Policy(cfg, 0, device, init_device_mesh(args.device, (1,)), model_path), cfg


def timed_update(policy, seqs, step: int, shared: int) -> tuple[float, dict]:
    import copy

    policy.mb.shared_prefix = shared
    batch = copy.deepcopy(seqs)
    if policy.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    metrics = policy.update(batch, 1, step)
    if policy.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, metrics


# Rows of the device timeline that are no kernel: CUPTI's "Command Buffer Full" marks the host waiting on a
# full launch queue (the GPU is the bottleneck), and would otherwise count as seconds of "other".
NOT_KERNELS = ("ProfilerStep", "aten::", "autograd::", "Optimizer.", "Command Buffer Full")


def kernel_split(prof) -> dict[str, float]:
    """GPU milliseconds of one profiled update by kind of kernel (KERNEL_KINDS; the rest is 'other')."""
    out: dict[str, float] = {k: 0.0 for k, _ in KERNEL_KINDS} | {"other": 0.0}
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", 0.0) or getattr(e, "self_cuda_time_total", 0.0)
        if not us or e.key.startswith(NOT_KERNELS):
            continue
        name = e.key.lower()
        kind = next((k for k, keys in KERNEL_KINDS if any(w in name for w in keys)), "other")
        out[kind] += us / 1e3
    return out


def top_kernels(prof, n: int = 8) -> list[tuple[str, float, int]]:
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", 0.0) or getattr(e, "self_cuda_time_total", 0.0)
        if us and not e.key.startswith(NOT_KERNELS):
            rows.append((e.key[:90], us / 1e3, e.count))
    return sorted(rows, key=lambda r: -r[1])[:n]


def profiled(policy, seqs, step: int, shared: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if policy.device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        seconds, _ = timed_update(policy, seqs, step, shared)
    return {"seconds": seconds, "split_ms": kernel_split(prof), "top": top_kernels(prof)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=["tiny", *SHAPES], default="7b")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None)
    p.add_argument("--steps", type=int, default=3, help="timed updates per variant (after one warm-up each)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--gens", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=185)
    p.add_argument("--response-len", type=int, default=256)
    p.add_argument("--shared-min", type=int, default=32, help="the shared variant's shared_prefix_min_tokens")
    p.add_argument("--profile", action="store_true", help="one profiled update per variant: kernel time split")
    p.add_argument("--set", nargs="*", default=[], help="extra dotted overrides of the trainer config")
    p.add_argument("--model-dir", type=Path, default=None, help="where the random model is written (default: tmp)")
    p.add_argument("--results", action="store_true", help=f"append the JSON line to {RESULTS}/update_<shape>_<card>_<date>.jsonl")
    args = p.parse_args()
    args.device = args.device or ("cpu" if args.shape == "tiny" else "cuda")
    with tempfile.TemporaryDirectory(prefix="update_bench_") as tmp:
        if args.shape == "tiny":
            from verl_agent.rollout.build import resolve_model_path

            model_path, shape = resolve_model_path("tiny"), None
        else:
            model_path, shape = str(build_model_dir(args.shape, args.model_dir or Path(tmp), args.device)), SHAPES[args.shape]
        policy, cfg = build_policy(args, model_path)
        vocab = policy.actor.config.vocab_size
        seqs = make_seqs(args.prompts, args.gens, args.prompt_len, args.response_len, vocab)
        variants = {"padded": 0, "shared": args.shared_min}
        times: dict[str, list[float]] = {k: [] for k in variants}
        metrics: dict[str, dict] = {}
        step = 1
        for name, k in variants.items():  # warm-up
            timed_update(policy, seqs, step, k)
            step += 1
        for _ in range(args.steps):
            for name, k in variants.items():
                t, metrics[name] = timed_update(policy, seqs, step, k)
                times[name].append(t)
                step += 1
        profiles = {name: profiled(policy, seqs, step + i, k) for i, (name, k) in enumerate(variants.items())} \
            if args.profile else {}
        peak = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else 0.0
    dev_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    flops = device_peaks(dev_name)[1]
    params = n_params(shape) if shape else sum(p.numel() for p in policy.actor.parameters())
    all_tokens = float(sum(s.num_tokens for s in seqs))
    result = {"bench": "update", "shape": args.shape, "device": dev_name, "date": time.strftime("%Y-%m-%d"),
              "sequences": len(seqs), "tokens": all_tokens, "budget_tokens": policy.mb.max_tokens,
              "peak_gpu_gib": peak, "steps": args.steps}
    for name in variants:
        sec = sum(times[name]) / len(times[name])
        ran = metrics[name]["perf/update_tokens"]
        result[name] = {"seconds": sec, "all": times[name], "tokens_run": ran,
                        "tokens_shared": metrics[name]["perf/update_tokens_shared"],
                        "mfu": 6 * params * ran / sec / flops, "padded_equivalent_mfu": 6 * params * all_tokens / sec / flops,
                        "grad_norm": metrics[name]["grad_norm"], "pg_loss": metrics[name]["pg_loss"]}
        if name in profiles:
            result[name]["profile"] = profiles[name]
    result["speedup"] = result["padded"]["seconds"] / result["shared"]["seconds"]
    result["saved_share"] = result["shared"]["tokens_shared"] / all_tokens
    print(f"\nupdate, {args.shape} on {dev_name}: {len(seqs)} sequences x {args.prompt_len}+{args.response_len} tokens, "
          f"micro-batch budget {policy.mb.max_tokens} tokens, peak {peak:.1f} GiB")
    print(f"{'variant':<8} {'seconds':>8} {'tokens run':>11} {'MFU':>6} {'padded-eq MFU':>14} {'grad norm':>10}")
    for name in variants:
        r = result[name]
        print(f"{name:<8} {r['seconds']:>8.3f} {r['tokens_run']:>11.0f} {100 * r['mfu']:>5.1f}% "
              f"{100 * r['padded_equivalent_mfu']:>13.1f}% {r['grad_norm']:>10.4f}")
    print(f"shared prefixes: {100 * result['saved_share']:.1f} % of the tokens not run again; "
          f"update {result['speedup']:.2f}x as fast")
    for name, prof in profiles.items():
        split = ", ".join(f"{k} {v:.0f}" for k, v in prof["split_ms"].items())
        print(f"{name} profile (GPU ms): {split}")
        for key, ms, count in prof["top"]:
            print(f"    {ms:9.1f} ms  x{count:<5} {key}")
    line = json.dumps(result)
    print(line)
    if args.results:
        card = device_peaks(dev_name)[2].split()[0] if args.device == "cuda" else "cpu"
        path = RESULTS / f"update_{args.shape}_{card}_{time.strftime('%Y-%m-%d')}.jsonl"
        with path.open("a") as f:
            f.write(line + "\n")
        print(f"appended to {path}")


if __name__ == "__main__":
    main()
