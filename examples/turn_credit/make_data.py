"""Write data/train.jsonl and data/test.jsonl: one match (ROUNDS secrets) per row.

    python examples/turn_credit/make_data.py

Every match has the same prompt (the secrets are hidden), so the test set is evaluation matches: played with
sampling and never trained on. With 4 rounds of 1..7 there are 7^4 = 2401 matches. The 49 evaluation matches
are an orthogonal array: (a, a+b, a+2b, a+3b) mod 7, so every secret is in every round 7 times and every two
rounds see every pair of secrets once. The 392 training matches are drawn (seeded) from the other 2352, so
no evaluation match is trained on. (A first version held out the secrets 3, 6, 9, 12 and 15 entirely;
training then never rewards saying those numbers, and held-out success measured that, not the strategy:
see README.md.) `extra_info.interaction_kwargs` = {"name": "hilo", "secrets": [...], "seed": ...}.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
from pathlib import Path

PROMPT = "Let's play higher or lower. Reply with just your guess."
# The game (interaction.yaml's env_kwargs and warm_start.py use the same): ROUNDS rounds, each a secret in
# LOW..HIGH found within GUESSES guesses.
LOW, HIGH, GUESSES, ROUNDS = 1, 7, 3, 4
N_TRAIN = 392  # 8 x 49; a run of 16 steps x 8 matches uses 128 of them (data.seed picks which)


def evaluation_matches() -> list[tuple[int, ...]]:
    """49 matches, an orthogonal array of strength 2 over 7 symbols: every pair of rounds sees every pair once."""
    n = HIGH - LOW + 1
    return [tuple(LOW + (a + k * b) % n if k else LOW + a for k in range(ROUNDS))  # k = 0: a; k >= 1: a + k b
            for a in range(n) for b in range(n)]


def training_matches() -> list[tuple[int, ...]]:
    held_out = set(evaluation_matches())
    rest = [m for m in itertools.product(range(LOW, HIGH + 1), repeat=ROUNDS) if m not in held_out]
    return random.Random(0).sample(rest, N_TRAIN)


def rows(split: str, matches: list[tuple[int, ...]]) -> list[dict]:
    return [{
        "data_source": "hilo",
        "prompt": [{"role": "user", "content": PROMPT}],
        "extra_info": {"split": split, "index": i,
                       "interaction_kwargs": {"name": "hilo", "secrets": list(m), "seed": i}},
    } for i, m in enumerate(matches)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "data"))
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for split, matches in (("train", training_matches()), ("test", evaluation_matches())):
        (out / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(split, matches)))


if __name__ == "__main__":
    main()
