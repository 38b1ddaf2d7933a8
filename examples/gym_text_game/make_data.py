"""Write data/train.jsonl and data/test.jsonl: one game per row, the secret number fixed by the row.

    python examples/gym_text_game/make_data.py

`extra_info.interaction_kwargs` = {"name": the interaction, "seed": reset's seed, others: reset's options}.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

PROMPT = "Let's play a number guessing game. Answer each time with just your guess."


def rows(n: int, split: str, seed: int, low: int = 1, high: int = 15) -> list[dict]:
    rng = random.Random(f"guess-{seed}-{split}")
    return [{
        "data_source": "guess_number",
        "prompt": [{"role": "user", "content": PROMPT}],
        "extra_info": {"split": split, "index": i,
                       "interaction_kwargs": {"name": "guess_number", "secret": rng.randint(low, high), "seed": i}},
    } for i in range(n)]


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
