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
import json
from pathlib import Path

PROMPT = "Let's play higher or lower. Reply with just your guess."
TEST_SECRETS = TRAIN_SECRETS = tuple(range(1, 16))


def rows(split: str, n: int) -> list[dict]:
    secrets = TEST_SECRETS if split == "test" else TRAIN_SECRETS
    return [{
        "data_source": "hilo",
        "prompt": [{"role": "user", "content": PROMPT}],
        "extra_info": {"split": split, "index": i,
                       "interaction_kwargs": {"name": "hilo", "secret": secrets[i % len(secrets)], "seed": i}},
    } for i in range(n)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "data"))
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", 90), ("test", 15)):
        (out / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(split, n)))


if __name__ == "__main__":
    main()
