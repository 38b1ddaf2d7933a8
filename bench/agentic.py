"""Agentic rollout benchmark: many multi-turn trajectories with tool waits, on the hf engine and a baseline.

  python bench/agentic.py                                   # CPU, tiny model, 32 trajectories
  python bench/agentic.py --shape 0.5b --device cuda --n 256
  python bench/agentic.py --shape 7b --device cuda --n 128 --rows continuous,continuous+kv,generate

Each trajectory: a random prompt, 1-4 assistant turns whose lengths come from a
fixed-seed distribution (enforced with per-request max_new_tokens, no EOS),
after every turn but the last a tool wait (asyncio.sleep) and tool output
tokens appended to the context. Rows, side by side in one run on one model:
  batch          per-batch scheduling (bench/baselines.py: every context prefilled whole)
  continuous     continuous batching, every turn re-prefills its whole context
  continuous+kv  continuous batching + per-session KV reuse (session = trajectory id)
  generate       raw transformers `generate` on equal work (batches of equal rows with
                 the workload's mean context and mean turn length; static cache on CUDA);
                 no tool waits: the ceiling for generated tok/s
Reported: trajectories/s, generated tok/s, prefill tok/s, busy share (time inside
forward + sampling / wall), p50/p99 turn latency. Every engine row is warmed up first.
Prints a table and one JSON line. Random weights are fine: only shapes matter.
On CUDA each engine row also gets a roofline line (bench/roofline.py): its decode ms per step against the
bandwidth floor for the shape, its mean rows and the workload's mean context while decoding.
Progress goes to stderr (bench/progress.py): the workload's size first, then for each engine row a line at
least every --progress-every seconds (graph capture, warm-up, run: tokens done, rate, time left at that
rate) and, after the warm-up, the longest the run can take at the warm-up's rate (more rows per decode step
only make it faster).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
from progress import Progress
from roofline import roofline, roofline_line

SHAPES = {
    "0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
             "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True},
    "7b": {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28, "num_attention_heads": 28,
           "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False},
}  # fmt: skip


@dataclass
class Trajectory:
    prompt: list[int]
    turns: list[tuple[int, float, list[int]]]  # (new tokens, tool wait s, tool tokens) per assistant turn


def workload(n: int, a: argparse.Namespace, vocab: int, seed: int) -> list[Trajectory]:
    rng = random.Random(seed)

    def ids(k: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(k)]

    out = []
    for _ in range(n):
        turns = []
        for t in range(rng.randint(1, a.max_turns)):
            wait = rng.uniform(a.wait_min, a.wait_max) if not a.no_tools else 0.0
            turns.append((rng.randint(a.turn_min, a.turn_max), wait, ids(rng.randint(a.tool_min, a.tool_max))))
        turns[-1] = (turns[-1][0], 0.0, [])  # the last turn ends the trajectory
        out.append(Trajectory(ids(a.prompt_len), turns))
    return out


def generated(trajs: list[Trajectory]) -> int:
    """Tokens the workload generates (each turn's max_new_tokens, no EOS)."""
    return sum(t for tr in trajs for t, _, _ in tr.turns)


async def run_engine(engine, trajs: list[Trajectory], sessions: bool,
                     progress: Progress | None = None) -> dict[str, float]:  # fmt: skip
    from verl_agent.engine.contract import SamplingParams

    lat: list[float] = []
    gen = prefill = 0

    async def one(i: int, tr: Trajectory) -> None:
        nonlocal gen, prefill
        ctx = list(tr.prompt)
        for new, wait, tool in tr.turns:
            t0 = time.perf_counter()
            sp = SamplingParams(temperature=1.0, max_new_tokens=new)
            out = await engine.generate(ctx, sp, session=f"traj-{i}" if sessions else None)
            lat.append(time.perf_counter() - t0)
            assert len(out.token_ids) == new, (len(out.token_ids), new, out.finish_reason)
            gen, prefill = gen + new, prefill + len(ctx)
            if progress is not None:
                progress.add(new)
            ctx += out.token_ids
            if wait:
                await asyncio.sleep(wait)
            ctx += tool
        await engine.release_session(f"traj-{i}")

    m0 = engine.metrics()
    t0 = time.perf_counter()
    await asyncio.gather(*(one(i, tr) for i, tr in enumerate(trajs)))
    wall = time.perf_counter() - t0
    m1 = engine.metrics()
    d = {k: m1[k] - m0.get(k, 0.0) for k in m1}
    prefilled = d.get("engine/prefill_tokens", prefill)  # the per-batch baseline prefills every context whole
    lat.sort()
    return {
        "wall_s": wall, "traj_per_s": len(trajs) / wall, "gen_tok_s": gen / wall, "prefill_tok_s": prefilled / wall,
        "busy_share": d["engine/busy_s"] / wall, "turn_p50_s": lat[len(lat) // 2],
        "turn_p99_s": lat[min(len(lat) - 1, int(len(lat) * 0.99))],
        "prefill_saved": d.get("engine/prefill_tokens_saved", 0.0), "gen_tokens": gen,
        **{k.split("/")[1]: d[k] for k in ("engine/prefill_s", "engine/decode_s", "engine/decode_steps",
                                           "engine/decode_rows", "engine/prefill_chunks") if k in d},
    }  # fmt: skip


async def engine_row(model, row: str, trajs, warm, a) -> dict[str, float]:
    from baselines import PerBatchEngine

    from verl_agent.engine.backends.hf_engine import HFEngine

    max_len = a.prompt_len + a.max_turns * (a.turn_max + a.tool_max)
    kw = {"device": a.device, "stop_on_eos": False, "seed": 0}
    sessions = row.endswith("kv")
    with Progress(f"{row} warm-up", generated(warm), every=a.progress_every) as bar:
        if row == "batch":
            engine = PerBatchEngine(model, max_batch_size=a.slots, **kw)
        else:
            engine = HFEngine(model, max_num_seqs=a.slots, max_model_len=max_len,
                              gpu_memory_utilization=a.gpu_memory_utilization, **kw)  # fmt: skip
            bar.phase = "capturing the decode graphs"
            graphs = await engine.capture_graphs()
            print(f"# {row}: {graphs} decode graphs captured in {bar.clock() - bar.start:.1f}s", file=sys.stderr)
            bar.phase = ""
        warm_res = await run_engine(engine, warm, sessions, bar)
    total = generated(trajs)
    print(f"# {row}: warm-up {warm_res['gen_tok_s']:,.0f} tok/s with {len(warm)} trajectories; the run's "
          f"{total:,} tokens take at most ~{total / warm_res['gen_tok_s']:,.0f}s at that rate", file=sys.stderr,
          flush=True)  # fmt: skip
    with Progress(row, total, every=a.progress_every) as bar:
        res = await run_engine(engine, trajs, sessions, bar)
    m = engine.metrics()
    res["cuda_graphs"] = m.get("engine/cuda_graphs", 0.0)
    res["kv_slots"] = m.get("engine/kv_slots", 0.0)
    await engine.close()
    if a.shape in SHAPES and a.device.startswith("cuda") and res.get("decode_steps"):
        res["roofline"] = roofline(SHAPES[a.shape], torch.cuda.get_device_name(),
                                   decode_ms=1e3 * res["decode_s"] / res["decode_steps"],
                                   rows=res["decode_rows"] / res["decode_steps"], mean_context=decode_context(trajs))
        print(f"# {row}: {roofline_line(res['roofline'])}", file=sys.stderr, flush=True)
    return res


def decode_context(trajs: list[Trajectory]) -> float:
    """Mean context length over the workload's generated tokens (what a decode step's rows attend to)."""
    total = weighted = 0.0
    for tr in trajs:
        n = len(tr.prompt)
        for t, _, tool in tr.turns:
            total, weighted = total + t, weighted + t * (n + t / 2)
            n += t + len(tool)
    return weighted / max(1.0, total)


def generate_row(model, trajs: list[Trajectory], a) -> dict[str, float]:
    """Raw `generate` on equal work: the same number of generated tokens in full batches of mean shape."""
    ctx, new = [], []
    for tr in trajs:
        n = len(tr.prompt)
        for t, _, tool in tr.turns:
            ctx.append(n)
            new.append(t)
            n += t + len(tool)
    plen, nnew, batch = round(statistics.mean(ctx)), round(statistics.mean(new)), min(len(trajs), a.slots)
    ids = torch.randint(3, model.config.vocab_size - 1, (batch, plen), device=a.device)
    kw = {"cache_implementation": "static"} if a.device.startswith("cuda") else {}
    for call in ("first (compiles the static-cache step on CUDA)", "second (timed)"):  # the warm call is timed
        sync(a.device)
        t0 = time.perf_counter()
        with _ticking(f"generate {batch}x({plen}+{nnew}), {call}", a.progress_every):
            model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=0, max_new_tokens=nnew,
                           min_new_tokens=nnew, pad_token_id=0, **kw)  # fmt: skip
            sync(a.device)
        dt = time.perf_counter() - t0
    tok_s = batch * nnew / dt
    total = sum(new)
    return {"wall_s": total / tok_s, "traj_per_s": len(trajs) * tok_s / total, "gen_tok_s": tok_s,
            "prefill_tok_s": batch * plen / dt, "busy_share": 1.0, "turn_p50_s": dt, "turn_p99_s": dt,
            "prefill_saved": 0.0, "gen_tokens": float(total), "shape": f"{batch}x({plen}+{nnew})"}  # fmt: skip


@contextlib.contextmanager
def _ticking(what: str, every: float):  # noqa: ANN202 - a context manager
    """A blocking call says it runs: a stderr line at its start, every `every` s, and at its end."""
    t0, done = time.perf_counter(), threading.Event()

    def tick() -> None:
        while not done.wait(every):
            print(f"# {what}: running for {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)

    print(f"# {what}: started", file=sys.stderr, flush=True)
    t = threading.Thread(target=tick, daemon=True)
    t.start()
    try:
        yield
    finally:
        done.set()
        t.join()
        print(f"# {what}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def build_model(a):
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    if a.shape == "tiny":
        from verl_agent.models.tiny import build_tiny

        return AutoModelForCausalLM.from_pretrained(str(build_tiny())).to(a.device).eval()
    cfg = Qwen2Config(max_position_embeddings=32768, eos_token_id=151643, **SHAPES[a.shape])
    dtype = torch.bfloat16 if a.device.startswith("cuda") else torch.float32
    with _ticking(f"building the {a.shape} model on {a.device}", a.progress_every), torch.device(a.device):
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()  # initialised where it runs: seconds


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=["tiny", "0.5b", "7b"], default="tiny")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--n", type=int, default=None, help="trajectories (default 256 on CUDA, 32 on CPU)")
    p.add_argument("--rows", default="batch,continuous,continuous+kv,generate")
    p.add_argument("--slots", type=int, default=None, help="hf engine's max_num_seqs / baseline's max_batch_size (default n)")
    p.add_argument("--max-turns", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=None, help="default 256 on CUDA, 32 on CPU")
    p.add_argument("--turn-min", type=int, default=None, help="default 32 (CUDA) / 8 (CPU)")
    p.add_argument("--turn-max", type=int, default=None, help="default 512 (CUDA) / 96 (CPU)")
    p.add_argument("--tool-min", type=int, default=None, help="default 20 (CUDA) / 5 (CPU)")
    p.add_argument("--tool-max", type=int, default=None, help="default 400 (CUDA) / 60 (CPU)")
    p.add_argument("--wait-min", type=float, default=0.01)
    p.add_argument("--wait-max", type=float, default=1.0)
    p.add_argument("--no-tools", action="store_true", help="tool waits of 0 s (tool tokens still appended)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--progress-every", type=float, default=15.0, help="seconds between progress lines (stderr)")
    a = p.parse_args()
    gpu = a.device.startswith("cuda")
    for k, g, c in [("n", 256, 32), ("prompt_len", 256, 32), ("turn_min", 32, 8), ("turn_max", 512, 96),
                    ("tool_min", 20, 5), ("tool_max", 400, 60)]:  # fmt: skip
        if getattr(a, k) is None:
            setattr(a, k, g if gpu else c)
    a.slots = a.slots or a.n
    return a


def main() -> None:
    a = parse()
    model = build_model(a)
    trajs = workload(a.n, a, model.config.vocab_size, a.seed)
    warm = workload(min(a.n, 16), argparse.Namespace(**{**vars(a), "no_tools": True}), model.config.vocab_size, 99)
    turns = [t for tr in trajs for t in tr.turns]
    print(f"# workload: {len(trajs)} trajectories, {len(turns)} turns, {generated(trajs):,} generated tokens, "
          f"{sum(w for _, w, _ in turns):,.0f}s of tool waits (concurrent); rows {a.rows}", file=sys.stderr,
          flush=True)  # fmt: skip
    res: dict[str, dict] = {}
    for row in a.rows.split(","):
        t0 = time.perf_counter()
        res[row] = generate_row(model, trajs, a) if row == "generate" else asyncio.run(engine_row(model, row, trajs, warm, a))
        print(f"# {row}: done in {time.perf_counter() - t0:.1f}s {json.dumps(res[row])}", file=sys.stderr, flush=True)
    cols = ["traj_per_s", "gen_tok_s", "prefill_tok_s", "busy_share", "turn_p50_s", "turn_p99_s", "prefill_saved"]
    print(f"{'row':<14}" + "".join(f"{c:>15}" for c in cols))
    for row, r in res.items():
        print(f"{row:<14}" + "".join(f"{r[c]:>15,.2f}" for c in cols))
    summary = {}
    if "batch" in res and "continuous+kv" in res:
        summary["kv_vs_batch_traj"] = res["continuous+kv"]["traj_per_s"] / res["batch"]["traj_per_s"]
    if "generate" in res and "continuous+kv" in res:
        summary["kv_vs_generate_tok"] = res["continuous+kv"]["gen_tok_s"] / res["generate"]["gen_tok_s"]
    for k, v in summary.items():
        print(f"{k}: {v:.2f}")
    name = torch.cuda.get_device_name() if a.device.startswith("cuda") else "cpu"
    print(json.dumps({"bench": "agentic", "shape": a.shape, "device": name, "n": a.n, "no_tools": a.no_tools,
                      "rows": res, **summary}))  # fmt: skip


if __name__ == "__main__":
    main()
