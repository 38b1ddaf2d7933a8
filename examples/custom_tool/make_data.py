"""Write data/train.jsonl and data/test.jsonl: shopping orders with per-row tool arguments.

    python examples/custom_tool/make_data.py

Each row's `extra_info.tools_kwargs` is keyed by tool name and holds the arguments of the
lifecycle steps: the shop's prices for `price_of` (execute_kwargs), the stock for the cart
(create_kwargs) and the order the cart is scored against (calc_reward_kwargs).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

FRUIT = ["apple", "pear", "banana", "orange", "plum", "mango", "lemon", "kiwi"]


def one_row(rng: random.Random, split: str, i: int) -> dict:
    picked = rng.sample(FRUIT, rng.choice([1, 2]))
    order = {f: rng.randint(1, 5) for f in picked}
    prices = {f: round(rng.uniform(0.2, 3.0), 2) for f in FRUIT}
    stock = {f: rng.randint(5, 12) for f in FRUIT}  # always enough for an order (1-5)
    wanted = " and ".join(f"{n} {f}{'s' if n > 1 else ''}" for f, n in order.items())
    return {
        "data_source": "shop",
        "prompt": [{"role": "user", "content": f"Please buy {wanted}, then tell me what they cost in total."}],
        "extra_info": {"split": split, "index": i, "tools_kwargs": {
            "price_of": {"execute_kwargs": {"prices": prices}},
            "add_to_cart": {"create_kwargs": {"stock": stock}, "calc_reward_kwargs": {"order": order}},
        }},
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "data"))
    ap.add_argument("--n-train", type=int, default=32)
    ap.add_argument("--n-test", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", args.n_train), ("test", args.n_test)):
        rng = random.Random(f"shop-{args.seed}-{split}")
        (out / f"{split}.jsonl").write_text("".join(json.dumps(one_row(rng, split, i)) + "\n" for i in range(n)))


if __name__ == "__main__":
    main()
