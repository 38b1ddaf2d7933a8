"""LoRA in the hf engine: merge the adapters into the weights at each sync, or compute them unmerged in
every forward. Prints a table and one JSON line.

    python bench/lora_engine.py                        # CPU, the embedded tiny model and a 0.5B-wide 4-layer model
    python bench/lora_engine.py --device cuda --shapes 0.5b

Per mode and model: seconds to apply one sync of rank --rank adapters on every linear layer (median of
--syncs, after one untimed sync), and decode throughput: --requests prompts of 16 tokens generating
--tokens tokens each (greedy, no early stop), the median of --repeat runs. Both modes sample the same tokens
(checked): the policy is the same, only where B A is added differs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {  # 0.5b: Qwen2-0.5B's widths on 4 layers (random weights), enough to make the matmuls count
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=4, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
}
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_model(shape: str, dtype):
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if shape == "tiny":
        from verl_agent.models.tiny import build_tiny

        return AutoModelForCausalLM.from_pretrained(str(build_tiny()), dtype=dtype)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(**SHAPES[shape], max_position_embeddings=4096)).to(dtype)


def adapters(model, rank: int, seed: int) -> list:
    """Random A and (scaled) B for every linear layer of the decoder, named as the trainer sends them."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in LINEAR:
            out.append((f"{name}.lora_A.weight", torch.randn(rank, module.in_features, generator=g) * 0.02))
            out.append((f"{name}.lora_B.weight", torch.randn(module.out_features, rank, generator=g) * 0.02))
    return out


async def measure(shape: str, mode: str, args) -> dict:
    import torch

    from verl_agent.engine.contract import SamplingParams
    from verl_agent.engine.backends.hf_engine import HFEngine

    dtype = getattr(torch, args.dtype)
    model = build_model(shape, dtype)
    engine = HFEngine(model, device=args.device, lora_mode=mode, max_num_seqs=args.requests, max_model_len=256,
                      stop_on_eos=False, kv_cache_bytes=256 << 20)
    tensors = adapters(engine.model, args.rank, 0)
    await engine.update_weights(tensors)  # untimed: the merge's base copies are made here
    syncs = []
    for i in range(args.syncs):
        tensors = adapters(engine.model, args.rank, i + 1)
        t0 = time.perf_counter()
        await engine.update_weights(tensors)
        if args.device == "cuda":
            torch.cuda.synchronize()
        syncs.append(time.perf_counter() - t0)
    sp = SamplingParams(temperature=0.0, max_new_tokens=args.tokens)
    prompts = [[5 + (i * 7 + j) % 200 for j in range(16)] for i in range(args.requests)]
    runs, tokens = [], None
    for _ in range(args.repeat + 1):
        t0 = time.perf_counter()
        outs = await asyncio.gather(*(engine.generate(p, sp) for p in prompts))
        runs.append(time.perf_counter() - t0)
        tokens = [o.token_ids for o in outs]
    await engine.close()
    sync_bytes = sum(t.numel() * torch.empty((), dtype=dtype).element_size() for _, t in tensors)
    return {"shape": shape, "mode": mode, "sync_s": statistics.median(syncs), "sync_bytes": sync_bytes,
            "decode_tok_s": args.requests * args.tokens / statistics.median(runs[1:]), "tokens": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["tiny", "0.5b"], choices=["tiny", *SHAPES])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--syncs", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = [asyncio.run(measure(shape, mode, args)) for shape in args.shapes for mode in ("merge", "unmerged")]
    print(f"{'shape':6} {'mode':9} {'sync ms':>9} {'sync MB':>8} {'decode tok/s':>13}")
    for r in rows:
        print(f"{r['shape']:6} {r['mode']:9} {r['sync_s'] * 1e3:9.2f} {r['sync_bytes'] / 1e6:8.2f} "
              f"{r['decode_tok_s']:13.1f}")
    same = {s: len({json.dumps(r["tokens"]) for r in rows if r["shape"] == s}) == 1 for s in args.shapes}
    print("same tokens in both modes:", same)
    print(json.dumps({"bench": "lora_engine", "device": args.device, "dtype": args.dtype, "rank": args.rank,
                      "rows": [{k: v for k, v in r.items() if k != "tokens"} for r in rows], "same_tokens": same}))


if __name__ == "__main__":
    main()
