"""Write data/train.jsonl and data/test.jsonl: one game per row.

    python examples/turn_credit/make_data.py

Every game has the same prompt (the secret is hidden), so the test set is evaluation games: each
secret 1..15 once, played with sampling and never trained on. (A first version held out the secrets
3, 6, 9, 12 and 15 entirely; training then never rewards saying those numbers, and held-out success
measured that, not the strategy: see README.md.) `extra_info.interaction_kwargs` =
{"name": "hilo", "secret": ..., "seed": ...}.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

PROMPT = "Let's play higher or lower. Reply with just your guess."
# The game (interaction.yaml's env_kwargs and warm_start.py use the same): ROUNDS rounds, each a secret in
# LOW..HIGH found within GUESSES guesses.
LOW, HIGH, GUESSES, ROUNDS = 1, 7, 3, 2
MATCHES = tuple(itertools.product(range(LOW, HIGH + 1), repeat=ROUNDS))  # every tuple of secrets: 49


def rows(split: str, n: int) -> list[dict]:
    return [{
        "data_source": "hilo",
        "prompt": [{"role": "user", "content": PROMPT}],
        "extra_info": {"split": split, "index": i,
                       "interaction_kwargs": {"name": "hilo", "secrets": list(MATCHES[i % len(MATCHES)]), "seed": i}},
    } for i in range(n)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "data"))
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", 2 * len(MATCHES)), ("test", len(MATCHES))):
        (out / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(split, n)))


if __name__ == "__main__":
    main()
