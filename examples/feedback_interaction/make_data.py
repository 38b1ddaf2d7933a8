"""Write data/train.jsonl and data/test.jsonl: arithmetic questions checked by the math_feedback interaction.

    python examples/feedback_interaction/make_data.py            # rewrites the shipped files

Each row is in verl's format; `extra_info.interaction_kwargs` picks the interaction
by name and gives it the ground truth, which it uses to answer "correct" or "try again".
The questions come from the calculator task so that the tiny model (trained on that
task) can take part; swap in your own questions (e.g. GSM8K) for a real model.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from verl_agent.models.calculator_task import SYSTEM_PROMPT, make_problems

SYSTEM = SYSTEM_PROMPT  # the tiny model was trained with this one; write your own for a real model


def rows(n: int, split: str, seed: int) -> list[dict]:
    out = []
    for i, p in enumerate(make_problems(n, seed=seed, split=split)):
        out.append({
            "data_source": "feedback_math",
            "prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": p["prompt"]}],
            "reward_model": {"style": "interaction", "ground_truth": p["answer"]},
            "extra_info": {"split": split, "index": i,
                           "interaction_kwargs": {"name": "math_feedback", "ground_truth": p["answer"]}},
        })
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "data"))
    ap.add_argument("--n-train", type=int, default=64)
    ap.add_argument("--n-test", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", args.n_train), ("test", args.n_test)):
        (out / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(n, split, args.seed)))


if __name__ == "__main__":
    main()
