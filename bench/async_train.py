"""Training throughput, sync vs one_step_off vs async, on an agent workload with slow environment turns.

Each trajectory talks to an environment for `--turns` assistant turns; every environment reply
takes a latency drawn from a fixed-seed log-uniform distribution (default 10 ms - 1 s, asyncio
sleep: a tool or a remote environment, not CPU work), and scores the episode pseudo-randomly so
GRPO has something to learn from. The same config runs once per mode, side by side in one process.
Timed are the steady-state steps: not the first (compilation, Ray start), nor the last `ahead` of a mode
that rolls out ahead (1 for one_step_off, max_staleness for async), which only finish what is in flight.

    python bench/async_train.py                                    # CPU, the tiny model
    python bench/async_train.py --device cuda --model 0.5b         # one GPU, a Qwen2-0.5B-shaped body
    python bench/async_train.py --split                            # + async with trainer.placement=split
    python bench/async_train.py --split auto object_store          # ... once per trainer.weight_transport
    python bench/async_train.py --device cuda --model 0.5b --modes async --split --rollout-gpus 1
                                                                   # two GPUs: the rollout worker on its own

Prints a table and one JSON line: trajectories trained per second per mode and the ratio to the first
mode (sync by default).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from verl_agent.interactions.base import BaseInteraction  # noqa: E402


class SlowEnvironment(BaseInteraction):
    """Replies after `latency` seconds (log-uniform in [lo, hi], seeded per episode) for `turns` turns."""

    async def start_interaction(self, instance_id: str | None = None, **kwargs: Any) -> str:
        iid = await super().start_interaction(instance_id, **kwargs)
        self.instances[iid]["rng"] = random.Random(iid)
        return iid

    async def generate_response(self, instance_id: str, messages: list[dict], **kwargs: Any):
        state = self.instances[instance_id]
        lo, hi = self.config.get("latency", [0.01, 1.0])
        await asyncio.sleep(math.exp(state["rng"].uniform(math.log(lo), math.log(hi))))
        state["turns"] += 1
        reply = messages[-1].get("content") or ""
        state["score"] = (len(reply) % 5) / 4  # something the policy can move
        return state["turns"] >= int(self.config.get("turns", 3)), "Go on.", 0.0, {}

    async def calculate_score(self, instance_id: str, **kwargs: Any) -> float:
        return float(self.instances[instance_id]["score"])


def _model(kind: str, out: Path) -> str:
    """'tiny' (the embedded model) or a random Qwen2 body of the 0.5B/7B shape with the tiny tokenizer."""
    from verl_agent.rollout.build import resolve_model_path

    tiny = resolve_model_path("tiny")
    if kind == "tiny":
        return tiny
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tok = AutoTokenizer.from_pretrained(tiny)
    shape = {"0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                          num_key_value_heads=2),
             "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                        num_key_value_heads=4)}[kind]  # fmt: skip
    cfg = Qwen2Config(vocab_size=len(tok), max_position_embeddings=4096, tie_word_embeddings=kind == "0.5b",
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **shape)
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


def _setup(args: argparse.Namespace, tmp: Path) -> list[str]:
    data = tmp / "train.jsonl"
    with data.open("w") as f:
        for i in range(args.batch * (args.steps + 4)):
            f.write(json.dumps({"prompt": f"Tell me something about the number {i}.", "answer": str(i),
                                "extra_info": {"interaction_kwargs": {"name": "slow"}}}) + "\n")
    inter = tmp / "interaction.yaml"
    inter.write_text(json.dumps({"interaction": [{"name": "slow", "class_name": f"{Path(__file__).resolve()}:SlowEnvironment",
                                                  "config": {"turns": args.turns, "latency": args.latency}}]}))
    model = _model(args.model, tmp / "model")
    gpu = args.device == "cuda"
    return [
        f"data.train_files=[{data}]", "data.val_files=[]", f"data.train_batch_size={args.batch}",
        "data.max_prompt_length=256", f"data.max_response_length={args.turns * (args.max_new + 16)}",
        f"actor_rollout_ref.model.path={model}", f"actor_rollout_ref.rollout.n={args.n}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.batch}", "actor_rollout_ref.actor.optim.lr=1e-5",
        f"actor_rollout_ref.rollout.multi_turn.interaction_config_path={inter}",
        f"actor_rollout_ref.rollout.multi_turn.max_user_turns={args.turns}",
        f"actor_rollout_ref.rollout.multi_turn.max_assistant_turns={args.turns}",
        f"trainer.total_training_steps={args.steps}", "trainer.val_before_train=false", "trainer.logger=[console]",
        "trainer.resume_mode=disable", "trainer.log_trajectories=false", f"trainer.device={args.device}",
        f"trainer.n_gpus_per_node={1 if gpu else 0}", f"trainer.num_cpu_workers={args.workers}",
        *(["actor_rollout_ref.model.dtype=bfloat16"] if gpu and args.model != "tiny" else []),
    ]


def stream_overlap(trace: Path) -> dict[str, float]:
    """From a torch.profiler Chrome trace of one step: seconds each CUDA stream ran kernels, and how long two
    or more ran at once (the engine's decode stream beside the trainer's default stream)."""
    import gzip

    events = json.loads(gzip.open(trace).read())["traceEvents"]
    kernels = [(e["ts"], e["ts"] + e["dur"], e["args"].get("stream")) for e in events
               if e.get("cat") == "kernel" and "dur" in e]
    if not kernels:
        return {}
    out = {"window_s": (max(k[1] for k in kernels) - min(k[0] for k in kernels)) / 1e6}
    edges = []  # sweep over start/end points: time with >= 1 and >= 2 streams busy
    for stream in {k[2] for k in kernels}:
        spans = sorted((a, b) for a, b, st in kernels if st == stream)
        merged = [list(spans[0])]
        for a, b in spans[1:]:
            if a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        out[f"stream_{stream}_busy_s"] = sum(b - a for a, b in merged) / 1e6
        edges += [(a, 1) for a, _ in merged] + [(b, -1) for _, b in merged]
    busy = both = 0.0
    level, last = 0, None
    for t, d in sorted(edges):
        if last is not None:
            busy += (t - last) * (level >= 1)
            both += (t - last) * (level >= 2)
        level, last = level + d, t
    out["any_busy_s"], out["overlap_s"] = busy / 1e6, both / 1e6
    return out


def run_mode(base: list[str], mode: str, staleness: int, tmp: Path, split: list[str] | None = None,
             profile_step: int | None = None) -> dict[str, float]:  # fmt: skip
    from verl_agent.config import load_config
    from verl_agent.trainer.loop import train

    staleness_key = [f"trainer.max_staleness={staleness}"] if mode == "async" else []
    name = f"run_{mode}_{staleness}" + "".join("_" + o.split("=")[1] for o in split or [])
    profile = [f"trainer.profile_steps=[{profile_step}]"] if profile_step else []
    cfg = load_config(None, [*base, f"trainer.mode={mode}", *staleness_key, *(split or []), *profile,
                             f"trainer.default_local_dir={tmp / name}"])
    result = train(cfg)
    if profile_step:  # printed now: the profiled step is slower (the profiler) and stays out of the table
        trace = next((cfg.run_dir / "profile").glob(f"step_{profile_step}_rank0.json.gz"))
        print(f"{name} step {profile_step} device streams: {json.dumps(stream_overlap(trace))}", flush=True)
    # Steady state only: the first step (compilation, Ray start) is left out, and so are the last `ahead`
    # steps of a mode that feeds batches ahead: nothing new is fed then (the run ends), so the engine only
    # finishes what is in flight and those steps would flatter the mode. In the window every step feeds one
    # batch and trains one, and as many batches are in flight at its end as at its start.
    ahead = cfg.trainer.batches_ahead
    warm = [m for i, m in enumerate(result.history[: len(result.history) - ahead]) if i and i + 1 != profile_step]
    if not warm:
        raise SystemExit(f"--steps {len(result.history)} leaves no steady-state step for {mode} (needs > {ahead + 1})")
    seconds = sum(m["time/step"] for m in warm)
    trajs = sum(m["rollout/num_trajectories"] for m in warm)
    return {"trajectories_per_s": trajs / seconds, "step_s": seconds / len(warm),
            "first_step_s": result.history[0]["time/step"],
            "rollout_wait_s": sum(m["time/rollout"] for m in warm) / len(warm),
            "log_probs_s": sum(m.get("time/log_probs", 0.0) for m in warm) / len(warm),
            "update_s": sum(m.get("time/update", 0.0) for m in warm) / len(warm),
            "weight_sync_s": sum(m.get("time/weight_sync", 0.0) for m in warm) / len(warm),
            "policy_lag_max": max(m["rollout/policy_lag/max"] for m in warm),
            # the engine's side: how fast a decode step is (it slows down while an update shares the device),
            # tokens generated per second of training, and turns cut by a weight update (partial rollout)
            "decode_step_ms": 1e3 * sum(m.get("engine/decode_s", 0.0) for m in warm)
            / max(1.0, sum(m.get("engine/decode_steps", 0.0) for m in warm)),
            "generated_tokens_per_s": sum(m.get("engine/generated_tokens", 0.0) for m in warm) / seconds,
            "turns_interrupted": sum(m.get("engine/requests_interrupted", 0.0) for m in warm) / len(warm),
            "reward_mean": sum(m["rollout/reward/mean"] for m in warm) / len(warm)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--model", default="tiny", choices=["tiny", "0.5b", "7b"])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch", type=int, default=8, help="prompts per step")
    p.add_argument("--n", type=int, default=4, help="trajectories per prompt")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-new", type=int, default=48, help="token budget of one assistant turn (approx.)")
    p.add_argument("--latency", type=float, nargs=2, default=[0.01, 1.0], metavar=("LO", "HI"))
    p.add_argument("--workers", type=int, default=2, help="CPU workers (cpu device)")
    p.add_argument("--staleness", type=int, default=2, help="async mode's max_staleness")
    p.add_argument("--profile-step", type=int, default=None, metavar="K",
                   help="torch.profiler over step K of each mode: print how long each CUDA stream ran kernels and "
                        "how long two ran at once (step K is then left out of the timing)")
    p.add_argument("--modes", nargs="+", default=["sync", "one_step_off", "async"],
                   choices=["sync", "one_step_off", "async"], help="the first one is the reference (x sync)")
    p.add_argument("--split", nargs="*", choices=["auto", "collective", "object_store"], default=None,
                   metavar="TRANSPORT", help="also async with trainer.placement=split (one rollout worker; on one GPU it gets half of "
                   "it, the train worker the other half), once per trainer.weight_transport given (default auto)")
    p.add_argument("--rollout-gpus", type=float, default=0.5, choices=[0.5, 1.0],
                   help="cuda, --split: the rollout worker's share of a GPU; 0.5 shares the train worker's card, "
                        "1 gives it its own (two GPUs; the weights then go by NCCL broadcast)")
    p.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                   help="config overrides for every mode, e.g. actor_rollout_ref.actor.ppo_max_token_len_per_gpu=16384")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="async-bench-"))
    base = _setup(args, tmp) + args.set
    rows = {}
    for mode in args.modes:
        k = {"sync": 0, "one_step_off": 1, "async": args.staleness}[mode]
        name = f"async(k={k})" if mode == "async" else mode
        rows[name] = run_mode(base, mode, k, tmp, profile_step=args.profile_step)
        print(f"{name}: {json.dumps(rows[name])}", flush=True)  # as each mode ends, in case a time limit cuts the run
    transports = [] if args.split is None else args.split or ["auto"]
    for transport in transports:
        split = ["trainer.placement=split", *([f"trainer.rollout_gpus_per_worker={args.rollout_gpus}"] if args.device == "cuda" else []),
                 f"trainer.weight_transport={transport}"]
        name = f"async(k={args.staleness}) split {transport}"
        rows[name] = run_mode(base, "async", args.staleness, tmp, split, profile_step=args.profile_step)
        print(f"{name}: {json.dumps(rows[name])}", flush=True)
    sync = next(iter(rows.values()))["trajectories_per_s"]
    print(f"\n{'mode':<34}{'traj/s':>9}{'x sync':>8}{'step s':>8}{'wait s':>8}{'logp s':>8}{'update s':>9}{'sync s':>8}{'lag':>5}"
          f"{'reward':>8}{'decode ms':>10}{'gen tok/s':>10}{'cut/step':>9}")
    for name, r in rows.items():
        print(f"{name:<34}{r['trajectories_per_s']:>9.2f}{r['trajectories_per_s'] / sync:>8.2f}{r['step_s']:>8.2f}"
              f"{r['rollout_wait_s']:>8.2f}{r['log_probs_s']:>8.2f}{r['update_s']:>9.2f}{r['weight_sync_s']:>8.3f}{r['policy_lag_max']:>5.0f}"
              f"{r['reward_mean']:>8.3f}{r['decode_step_ms']:>10.2f}{r['generated_tokens_per_s']:>10.0f}"
              f"{r['turns_interrupted']:>9.1f}")
    print(json.dumps({"bench": "async_train", "device": args.device, "model": args.model, "args": vars(args),
                      "modes": rows, "speedup": {k: r["trajectories_per_s"] / sync for k, r in rows.items()}}))


if __name__ == "__main__":
    main()
