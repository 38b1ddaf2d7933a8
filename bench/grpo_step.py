"""One GRPO step, ours vs TRL's GRPOTrainer, on the same shape in one run. Prints a table and one JSON line.

  python bench/grpo_step.py --shape 0.5b                 # one GPU: ours, then TRL 1.16 (if installed), same batch
  python bench/grpo_step.py --shape 7b --no-trl          # ours only; checkpoint + HF export at the end
  python bench/grpo_step.py --shape tiny --device cpu    # the CPU demo's step (examples/calculator, 2 gloo workers)
  python bench/grpo_step.py --shape 7b --no-trl --lora-rank 32 --full-too
                                                         # LoRA r=32 on all linear layers, engine awake, and the
                                                         # full fine-tune in the same run (ratio of warm steps)
  python bench/grpo_step.py --shape 7b --no-trl --lora-rank 32 --full-too \
      --full-set actor_rollout_ref.model.dtype=bfloat16 actor_rollout_ref.rollout.free_cache_engine=true \
      --lora-set actor_rollout_ref.actor.ppo_max_token_len_per_gpu=8192   # each run its own settings
  python bench/grpo_step.py --shape 14b --no-trl --lora-rank 32   # Qwen2.5-14B's shape: LoRA on one GPU

Shapes: 0.5b, 7b, 14b and 32b are Qwen2-0.5B / Qwen2-7B / Qwen2.5-14B / Qwen2.5-32B configurations with
random weights (bf16 on disk; 32b needs ~66 GB of disk: --model-dir) and a
character-level tokenizer of the same vocabulary size (`char_tokenizer`), so a prompt of 128 letters is
128 tokens (plus the chat template's ~45) on both sides. Both trainers: 8 prompts x 8 samples, 256 new
tokens, temperature 1, fp32 master weights with bf16 compute, gradient checkpointing, no KL (beta 0).

Our side runs through the public API only: `load_config(path, overrides)` -> `train(cfg)` -> the
per-step `time/*` metrics of `TrainResult.history`. Step 1 is reported as "first"; "warm" is the mean
of the later steps (but the one --profile-step names: the profiler slows it). Peak GPU memory is sampled with nvidia-smi (all processes), peak host RSS by
summing /proc RSS of this process and all its descendants (Ray's workers included) every 0.25 s.
MFU of the update = 6 x parameters x trained tokens / update seconds / the card's dense bf16 peak.
A roofline line (bench/roofline.py) sets decode ms per step against the bandwidth floor for the shape and
rows, and the update against 6ND / peak FLOP/s. `--results` appends the JSON line to
bench/results/grpo_step_<shape>_<card>_<date>.jsonl, so that figures in the docs trace back to a run.

--lora-rank R (lora_alpha 2R, --target-modules, default all-linear): the frozen base in bf16 with fp32
adapters, the engine awake during the update (rollout.free_cache_engine=false); the table adds the adapter
parameters, the bytes and seconds of one weight sync (adapters only) and, with --full-too, the full
fine-tune's warm step measured first in the same process, and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import string
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from memory import tree_rss  # noqa: E402 - bench/ is the script's dir
from roofline import device_peaks, n_params, roofline, roofline_line  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = {  # Qwen2-0.5B and Qwen2-7B (config.json of the released models)
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "14b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
    "32b": dict(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64, num_attention_heads=40,
                num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
}
PHASES = ("step", "rollout", "log_probs", "advantages", "update", "weight_sync")
PER_STEP_KEYS = ("time/step", "time/rollout", "time/update", "engine/prefill_s", "engine/decode_s",
                 "engine/decode_steps")
ENGINE_KEYS = ("prefill_s", "decode_s", "decode_steps", "decode_rows", "graph_capture_s", "graph_captures",
               "prefill_tokens", "prefill_tokens_shared")


def bench_reward(generated_text: str, ground_truth: str) -> float:
    """A reward that differs between samples of a group (so advantages are not all zero)."""
    return float(sum(map(ord, generated_text)) % 7) / 6.0


# -- model + data ---------------------------------------------------------------------------------


def char_tokenizer(vocab_size: int):
    """A byte-level BPE without merges (one token per character), ChatML specials, exactly vocab_size ids.

    transformers 5 loads a Qwen2 model's tokenizer as Qwen2Tokenizer whatever tokenizer.json says, with
    Qwen2's pre-tokenizer: a byte-level vocabulary without merges tokenizes the same way under both, so
    a prompt of N letters is N tokens on our side and on TRL's. The ids above the byte alphabet are
    fillers ("w123") that the random model may sample."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from verl_agent.models.tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS, TOOL_TAGS

    vocab = {t: i for i, t in enumerate(list(SPECIAL_TOKENS) + list(TOOL_TAGS))}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab.setdefault(ch, len(vocab))
    vocab.update({f"w{i}": i for i in range(len(vocab), vocab_size)})
    tok = Tokenizer(models.BPE(vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIAL_TOKENS[2], pad_token=SPECIAL_TOKENS[0],
                                   model_max_length=32768)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model_dir(shape: str, root: Path, device: str) -> Path:
    """Random-weight Qwen2 of the given shape + character tokenizer, saved in bf16 (initialised on the device)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    out = root / f"qwen2-{shape}"
    if (out / "config.json").is_file() and (out / "tokenizer.json").is_file():  # a --model-dir written earlier
        return out
    cfg = Qwen2Config(**SHAPES[shape], max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
                      bos_token_id=None, eos_token_id=2, pad_token_id=0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(out)
    char_tokenizer(cfg.vocab_size).save_pretrained(out)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def write_prompts(path: Path, rows: int, chars: int, seed: int = 0) -> Path:
    import random

    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(rows):
            f.write(json.dumps({"prompt": "".join(rng.choice(string.ascii_lowercase) for _ in range(chars)),
                                "answer": str(i)}) + "\n")
    return path


# -- monitors -------------------------------------------------------------------------------------


class Peaks:
    """Samples GPU memory used (nvidia-smi, MiB) and the RSS of this process tree (bytes) in a thread."""

    def __init__(self, gpu: bool, period: float = 0.25) -> None:
        self.gpu, self.period = gpu, period
        self.gpu_mib = self.rss = self.rss_one = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Peaks:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            rss = list(tree_rss(os.getpid()).values())
            self.rss, self.rss_one = max(self.rss, sum(rss)), max(self.rss_one, max(rss, default=0))
            if self.gpu:
                self.gpu_mib = max(self.gpu_mib, _gpu_used_mib())


def _gpu_used_mib() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=5).stdout
        return sum(int(x) for x in out.split())
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return 0


# -- ours -----------------------------------------------------------------------------------------


def lora_overrides(rank: int, targets: list[str] | None) -> list[str]:
    """LoRA at `rank` (alpha 2 x rank) on `targets` (default all-linear), the engine awake during the update."""
    if rank <= 0:
        return []
    target = "all-linear" if not targets or targets == ["all-linear"] else "[" + ",".join(targets) + "]"
    return [f"actor_rollout_ref.model.lora_rank={rank}", f"actor_rollout_ref.model.lora_alpha={2 * rank}",
            f"actor_rollout_ref.model.target_modules={target}", "actor_rollout_ref.rollout.free_cache_engine=false"]


def run_ours(args, model_dir: Path | None, work: Path, lora_rank: int = 0, extra: Sequence[str] = ()) -> dict:
    """Our trainer through train(cfg); per-phase seconds from the history. `extra`: overrides after --set."""
    from verl_agent.config import load_config
    from verl_agent.trainer.loop import train

    shutil.rmtree(work / "run", ignore_errors=True)  # --full-too: the second run starts afresh
    common = [f"trainer.total_training_steps={args.steps}", "trainer.val_before_train=false",
              "trainer.logger=[console]", f"trainer.default_local_dir={work / 'run'}", "trainer.resume_mode=disable"]
    common += lora_overrides(lora_rank, args.target_modules)
    if args.profile_step:
        common.append(f"trainer.profile_steps=[{args.profile_step}]")
    if args.shape == "tiny":
        cfg = load_config("examples/calculator/config.yaml", common + ["data.val_files=[]"] + args.set + list(extra))
    else:
        data = write_prompts(work / "prompts.jsonl", args.prompts * args.steps, args.prompt_len)
        cfg = load_config(None, common + [
            f"data.train_files=[{data}]", f"data.train_batch_size={args.prompts}",
            f"data.max_prompt_length={args.prompt_len + 64}", f"data.max_response_length={args.new_tokens}",
            f"data.reward_fn={Path(__file__).resolve()}:bench_reward",
            f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.model.dtype=float32",
            "actor_rollout_ref.model.enable_gradient_checkpointing=true", "actor_rollout_ref.rollout.dtype=bfloat16",
            f"actor_rollout_ref.rollout.n={args.gens}", "actor_rollout_ref.rollout.temperature=1.0",
            f"actor_rollout_ref.rollout.max_batch_size={args.prompts * args.gens}",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}", "actor_rollout_ref.actor.optim.lr=1e-6",
            f"trainer.n_gpus_per_node={int(args.device == 'cuda')}", "trainer.save_freq=-1",
        ] + args.set + list(extra))
    t0 = time.perf_counter()
    error, export_ok, workers = None, False, []
    with Peaks(gpu=args.device == "cuda") as peaks:
        try:
            result = train(cfg)
            hist, workers = result.history, result.workers
            export_ok = bool(result.export_dir and Path(result.export_dir).is_dir())
        except Exception as e:  # keep what the steps measured (metrics.jsonl) and say what broke
            error = f"{type(e).__name__}: {e}"[:600]
            rows = [json.loads(line) for line in (work / "run" / "metrics.jsonl").open()] \
                if (work / "run" / "metrics.jsonl").is_file() else []
            hist = [r for r in rows if "time/step" in r]
    total = time.perf_counter() - t0
    if args.profile_step and (work / "run" / "profile").is_dir():  # the run dir is temporary: keep the profiles
        shutil.copytree(work / "run" / "profile", args.profile_dir / args.shape, dirs_exist_ok=True)
    syncs = [h for i, h in enumerate(hist, start=1) if i > 1 or len(hist) == 1]
    out = {"total_s": total, "steps": len(hist), "peak_gpu_gib": peaks.gpu_mib / 1024, "lora_rank": lora_rank,
           "trainable_parameters": workers[0].get("trainable_parameters", 0) if workers else 0,
           "sync_bytes": syncs[-1].get("perf/weight_sync_bytes", 0.0) if syncs else 0.0,
           "sync_worker_s": sum(h.get("time/weight_sync_worker", 0.0) for h in syncs) / max(1, len(syncs)),
           "peak_rss_gib": peaks.rss / 2**30, "peak_rss_one_process_gib": peaks.rss_one / 2**30,
           "export_ok": export_ok, "error": error,
           "checkpoint_s": max((h.get("time/checkpoint", 0.0) for h in hist), default=0.0)}
    for ph in PHASES:
        vals = [h.get(f"time/{ph}", 0.0) for h in hist]
        out[f"first_{ph}"] = vals[0] if vals else 0.0
        warm = [v for i, v in enumerate(vals[1:], start=2) if i != args.profile_step]  # profiling slows its step
        out[f"warm_{ph}"] = sum(warm) / max(1, len(warm))
    for key in ENGINE_KEYS:  # where the rollout's time goes (the engine's counters, per step)
        vals = [h.get(f"engine/{key}", 0.0) for i, h in enumerate(hist[1:], start=2) if i != args.profile_step]
        out[f"warm_engine_{key}"] = sum(vals) / max(1, len(vals))
    # every step's own figures, so a mean over warm steps can be told from one step's outlier
    out["per_step"] = {key: [round(h.get(key, 0.0), 4) for h in hist] for key in PER_STEP_KEYS}
    last = hist[-1] if hist else {}
    n = last.get("rollout/num_trajectories", 0.0)
    out["tokens_per_step"] = n * (last.get("rollout/prompt_length/mean", 0.0)
                                  + last.get("rollout/response_length/mean", 0.0))
    out["new_tokens_per_step"] = n * last.get("rollout/response_length/mean", 0.0)
    out["update_tokens_run"] = last.get("perf/update_tokens", 0.0)  # the update's forward: shared prefixes once
    out["update_tokens_shared"] = last.get("perf/update_tokens_shared", 0.0)
    out["prompt_len_mean"] = last.get("rollout/prompt_length/mean", 0.0)
    out["response_len_mean"] = last.get("rollout/response_length/mean", 0.0)
    return out


# -- TRL ------------------------------------------------------------------------------------------


def run_trl(args, model_dir: Path, work: Path) -> dict:
    """TRL 1.16 GRPOTrainer on the same model, prompts and batch; seconds per optimizer step."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    rows = [json.loads(line) for line in write_prompts(work / "trl.jsonl", args.prompts * args.steps,
                                                       args.prompt_len).open()]
    rows = [{"prompt": [{"role": "user", "content": r["prompt"]}]} for r in rows]  # chat template, as ours
    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t0)

    per_device = args.prompts * args.gens // 4
    conf = GRPOConfig(
        output_dir=str(work / "trl"), per_device_train_batch_size=per_device, gradient_accumulation_steps=4,
        num_generations=args.gens, max_completion_length=args.new_tokens, max_steps=args.steps,
        learning_rate=1e-6, beta=0.0, bf16=True, gradient_checkpointing=True, temperature=1.0,
        logging_steps=1, save_strategy="no", report_to=[], use_vllm=False, shuffle_dataset=False, seed=0,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    def reward(completions, **kw):  # conversational prompts: each completion is [{"role": "assistant", ...}]
        return [bench_reward(c if isinstance(c, str) else c[-1]["content"], "") for c in completions]

    trainer = GRPOTrainer(model=model, reward_funcs=reward,
                          args=conf, train_dataset=Dataset.from_list(rows), processing_class=tok, callbacks=[Timer()])
    torch.cuda.reset_peak_memory_stats()
    with Peaks(gpu=True) as peaks:
        trainer.train()
    return {"steps": len(times), "first_step": times[0] if times else 0.0,
            "warm_step": sum(times[1:]) / max(1, len(times) - 1), "peak_gpu_gib": peaks.gpu_mib / 1024,
            "peak_rss_gib": peaks.rss / 2**30}


def _try_trl(args, model_dir: Path, work: Path) -> dict | None:
    try:
        return run_trl(args, model_dir, work)
    except Exception as e:  # TRL is optional: report ours anyway
        print(f"TRL failed: {type(e).__name__}: {e}", file=sys.stderr)
        return None


# -- report ---------------------------------------------------------------------------------------


def report(args, ours: dict, trl: dict | None, full: dict | None = None) -> dict:
    rows = [("first step (s)", ours["first_step"], trl["first_step"] if trl else None),
            ("warm step (s)", ours["warm_step"], trl["warm_step"] if trl else None)]
    rows += [(f"  warm {ph} (s)", ours[f"warm_{ph}"], None) for ph in PHASES[1:]]
    steps = ours.get("warm_engine_decode_steps", 0.0)
    if steps:  # the rollout's parts, from the engine's counters
        capture = ours["warm_engine_graph_capture_s"]
        rows += [("    engine prefill (s)", ours["warm_engine_prefill_s"], None),
                 ("    engine prompt tokens prefilled", ours["warm_engine_prefill_tokens"], None),
                 ("    engine prompt tokens copied from a group's first sample", ours["warm_engine_prefill_tokens_shared"],
                  None),
                 ("    engine decode steps (count)", steps, None),
                 ("    engine decode, per step (ms)", 1e3 * (ours["warm_engine_decode_s"] - capture) / steps, None),
                 ("    engine CUDA-graph captures (s)", capture, None),
                 ("    engine CUDA-graph captures (count)", ours["warm_engine_graph_captures"], None),
                 ("    rollout outside the engine's forwards (s)",
                  ours["warm_rollout"] - ours["warm_engine_prefill_s"] - ours["warm_engine_decode_s"], None)]
    out = {"shape": args.shape, "device": args.device, "device_name": args.device_name, "ours": ours, "trl": trl,
           "full": full, "argv": sys.argv[1:]}  # fmt: skip
    if ours["lora_rank"]:
        rows += [(f"LoRA rank {ours['lora_rank']}: adapter parameters", ours["trainable_parameters"], None),
                 ("  weight sync: bytes to one engine (MB)", ours["sync_bytes"] / 1e6, None),
                 ("  weight sync: seconds on the worker (warm mean)", ours["sync_worker_s"], None)]
    if full is not None:
        rows += [("full fine-tune warm step (s), same run", full["warm_step"], None),
                 ("full fine-tune peak GPU memory (GiB)", full["peak_gpu_gib"], None)]
        if full["warm_step"] > 0:
            out["lora_over_full_warm_step"] = ours["warm_step"] / full["warm_step"]
            rows.append(("LoRA warm step / full fine-tune's", out["lora_over_full_warm_step"], None))
    if args.shape in SHAPES and ours["warm_update"] > 0 and not ours["lora_rank"]:  # 6ND: every weight trained
        _, peak, card = device_peaks(args.device_name)
        flops = 6 * n_params(SHAPES[args.shape]) * ours["tokens_per_step"]
        out["update_mfu"] = flops / ours["warm_update"] / peak
        rows.append((f"update MFU (6ND / {peak / 1e12:.0f} TFLOP/s, {card}; N = all tokens)", out["update_mfu"], None))
        if ours["update_tokens_shared"]:  # shared prefixes ran once: the FLOPs really spent are fewer
            out["update_mfu_tokens_run"] = out["update_mfu"] * ours["update_tokens_run"] / ours["tokens_per_step"]
            rows += [("  update tokens shared (not run again) / run", ours["update_tokens_shared"], None),
                     ("  update tokens run", ours["update_tokens_run"], None),
                     ("  update MFU on the tokens run", out["update_mfu_tokens_run"], None)]
    if args.shape in SHAPES and steps and args.device == "cuda":
        out["roofline"] = roofline(
            SHAPES[args.shape], args.device_name,
            decode_ms=1e3 * (ours["warm_engine_decode_s"] - ours["warm_engine_graph_capture_s"]) / steps,
            rows=ours["warm_engine_decode_rows"] / steps,
            mean_context=ours["prompt_len_mean"] + ours["response_len_mean"] / 2,
            update_s=ours["warm_update"], tokens=ours["tokens_per_step"])  # fmt: skip
    if ours["warm_step"] > 0:
        out["tokens_per_s"] = ours["tokens_per_step"] / ours["warm_step"]
        rows.append(("tokens/s (prompt+response, warm step)", out["tokens_per_s"], None))
    rows += [("peak GPU memory (GiB, nvidia-smi)", ours["peak_gpu_gib"], trl["peak_gpu_gib"] if trl else None),
             ("peak host RSS, process tree (GiB)", ours["peak_rss_gib"], trl["peak_rss_gib"] if trl else None),
             ("peak host RSS, one process (GiB)", ours["peak_rss_one_process_gib"], None),
             ("final checkpoint (s)", ours["checkpoint_s"], None),
             ("run incl. load, checkpoint, export (s)", ours["total_s"], None)]
    if trl and ours["warm_step"] > 0:
        out["speedup_vs_trl"] = trl["warm_step"] / ours["warm_step"]
        rows.append(("TRL warm step / ours", out["speedup_vs_trl"], None))
    print(f"\n| {args.shape} on {args.device} | verl-agent | TRL 1.16 |\n| --- | --- | --- |")
    for name, a, b in rows:
        print(f"| {name} | {a:.3g} | {'' if b is None else f'{b:.3g}'} |")
    print(f"export written: {ours['export_ok']}" + (f"; ERROR: {ours['error']}" if ours["error"] else ""))
    if "roofline" in out:
        print(roofline_line(out["roofline"]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=["tiny", *SHAPES], default="0.5b")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--gens", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--no-trl", action="store_true", help="skip TRL (always skipped for --shape tiny)")
    p.add_argument("--trl-first", action="store_true", help="run TRL before ours")
    p.add_argument("--set", nargs="*", default=[], help="extra dotted overrides of our config")
    p.add_argument("--json", type=Path, default=None, help="also write the JSON result here")
    p.add_argument("--profile-step", type=int, default=0, help="profile this step (trainer.profile_steps)")
    p.add_argument("--profile-dir", type=Path, default=Path("profile"), help="where the profiles are copied")
    p.add_argument("--model-dir", type=Path, default=None, help="where the random model is written (default: tmp); one written there earlier is reused")
    p.add_argument("--results", action="store_true", help=f"append the JSON line to {RESULTS}/<shape>_<card>_<date>")
    p.add_argument("--lora-rank", type=int, default=0, help="LoRA rank (0: full fine-tuning)")
    p.add_argument("--target-modules", nargs="*", default=None, help="LoRA target modules (default all-linear)")
    p.add_argument("--full-too", action="store_true", help="with --lora-rank: the full fine-tune first, same run")
    p.add_argument("--full-set", nargs="*", default=[], help="overrides of the --full-too run only (after --set)")
    p.add_argument("--lora-set", nargs="*", default=[], help="overrides of the LoRA run only (after --set)")
    args = p.parse_args()
    args.device = args.device or ("cpu" if args.shape == "tiny" else "cuda")
    args.device_name = _device_name(args.device)
    os.environ.setdefault("RAY_TMPDIR", os.path.join(tempfile.gettempdir(), "ray"))
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    with tempfile.TemporaryDirectory(prefix="grpo_bench_") as tmp:
        work = Path(tmp)
        model_dir = build_model_dir(args.shape, args.model_dir or work, args.device) if args.shape in SHAPES else None
        use_trl = not args.no_trl and args.shape in SHAPES
        trl = _try_trl(args, model_dir, work) if use_trl and args.trl_first else None
        full = run_ours(args, model_dir, work, extra=args.full_set) if args.full_too and args.lora_rank else None
        ours = run_ours(args, model_dir, work, args.lora_rank, extra=args.lora_set)
        if use_trl and not args.trl_first:
            trl = _try_trl(args, model_dir, work)
        result = report(args, ours, trl, full)
    line = json.dumps(result)
    print(line)
    if args.json:
        args.json.write_text(line + "\n")
    if args.results:
        card = device_peaks(args.device_name)[2].split()[0] if args.device == "cuda" else "cpu"
        path = RESULTS / f"grpo_step_{args.shape}_{card}_{time.strftime('%Y-%m-%d')}.jsonl"
        path.parent.mkdir(exist_ok=True)
        with path.open("a") as f:
            f.write(line + "\n")
        print(f"appended to {path}")


def _device_name(device: str) -> str:
    if device != "cuda":
        return "cpu"
    import torch

    return torch.cuda.get_device_name()


if __name__ == "__main__":
    main()
