"""Write data/train.jsonl and data/test.jsonl: one corridor per row, codes 10..99.

    python examples/long_horizon/make_data.py

The held-out codes (test) are never a training code: every 5th code (10, 15, ..., 95) is held out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from corridor import PROMPT  # noqa: E402

TEST_CODES = list(range(10, 100, 5))
TRAIN_CODES = [c for c in range(10, 100) if c not in TEST_CODES]


def rows(split: str, codes: list[int], seed0: int) -> list[dict]:
    return [{"data_source": "corridor", "prompt": [{"role": "user", "content": PROMPT.format(code=c)}],
             "extra_info": {"split": split, "index": i,
                            "interaction_kwargs": {"name": "corridor", "code": str(c), "seed": seed0 + i}}}
            for i, c in enumerate(codes)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(HERE / "data"))
    out = Path(ap.parse_args(argv).out)
    out.mkdir(parents=True, exist_ok=True)
    for split, codes, seed0 in (("train", TRAIN_CODES, 0), ("test", TEST_CODES, 10_000)):
        (out / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(split, codes, seed0)))


if __name__ == "__main__":
    main()
