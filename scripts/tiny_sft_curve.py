"""Learning curve of the tiny model's SFT warm start: how well it copies, step by step.

Trains a tiny-model recipe exactly as `verl-agent model build-tiny` does (same data, schedule and loss)
and every `--eval-every` steps prints the teacher-forced, greedy accuracy on the digits of held-out
tool chats: the digits the model must copy (expression into the call, result into the answer). Use it
to compare recipes before changing TinySettings; any TinySettings field is an option:

    python scripts/tiny_sft_curve.py                      # the current recipe
    python scripts/tiny_sft_curve.py --steps 1500 --n_train_problems 4000 --num_kv_heads 2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from verl_agent.chat import ChatEncoder
from verl_agent.models.calculator_task import CALCULATOR_TOOL_SCHEMA, make_problems
from verl_agent.models.sft_data import conversation, encode_conversation
from verl_agent.models.sft_train import make_dataset, train
from verl_agent.models.tiny import TinySettings


@torch.no_grad()
def copy_accuracy(model, held: list[tuple[list[int], list[int]]]) -> tuple[float, float]:
    """(digit accuracy, share of chats with every digit right), greedy and teacher-forced."""
    model.eval()
    right = total = whole = 0
    for ids, positions in held:
        pred = model(input_ids=torch.tensor([ids])).logits[0].argmax(-1)
        ok = [pred[i - 1].item() == ids[i] for i in positions]
        right, total, whole = right + sum(ok), total + len(ok), whole + all(ok)
    model.train()
    return right / total, whole / len(held)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for k, v in dataclasses.asdict(TinySettings()).items():
        ap.add_argument(f"--{k}", type=type(v), default=v)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    s = TinySettings(**{k: getattr(args, k) for k in dataclasses.asdict(TinySettings())})
    torch.manual_seed(args.seed)
    tok, groups = make_dataset(make_problems(s.n_train_problems, seed=args.seed, split="train"), s, args.seed)
    enc, rng = ChatEncoder(tok, tools=[CALCULATOR_TOOL_SCHEMA]), random.Random(args.seed + 5)
    digits = {tok.convert_tokens_to_ids(str(d)) for d in range(10)}
    held = []
    for p in make_problems(96, seed=args.seed + 1, split="test"):
        ids, mask = encode_conversation(enc, conversation(p, True, rng))
        held.append((ids, [i for i, (t, m) in enumerate(zip(ids, mask)) if m and t in digits]))
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(tok), hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
        num_hidden_layers=s.num_layers, num_attention_heads=s.num_heads, num_key_value_heads=s.num_kv_heads,
        tie_word_embeddings=True, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))
    rows, t0 = [], time.perf_counter()
    print(f"{'step':>6} {'seconds':>8} {'loss':>7} {'digit acc':>10} {'whole copy':>11}")

    def report(step: int, loss: float) -> None:
        acc, whole = copy_accuracy(model, held)
        rows.append({"step": step, "seconds": round(time.perf_counter() - t0), "loss": round(loss, 4),
                     "digit_acc": round(acc, 3), "whole_copy": round(whole, 3)})
        print(f"{step:>6} {rows[-1]['seconds']:>8} {loss:>7.3f} {acc:>10.3f} {whole:>11.3f}", flush=True)

    train(model, groups, s, args.seed, on_step=lambda step, losses: report(step, sum(losses[-50:]) / len(losses[-50:]))
          if step % args.eval_every == 0 or step == s.steps else None)
    print(json.dumps({"settings": dataclasses.asdict(s), "curve": rows}))


if __name__ == "__main__":
    main()
