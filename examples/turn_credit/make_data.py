"""Write data/train.jsonl and data/test.jsonl.

    python examples/turn_credit/make_data.py

Every row has the same prompt (the secrets are hidden). The test set is 49 evaluation matches, fixed by their
rows (`interaction_kwargs` = {"name": "hilo", "secrets": [...], "seed": i}), played with sampling. They are an
orthogonal array: (a, a+b, a+2b, a+3b) mod 7, so every secret is in every round 7 times and every two rounds
see every pair of secrets once. The 392 training rows give only a seed ({"name": "hilo", "seed": i}): the env
(`random_secrets: true` in interaction.yaml) draws a new match of the 7^4 for every trajectory, so the 8
samples of a row (one GRPO group) face different secrets. A random match is one of the 49 evaluation matches
with probability 2 %; since the secrets are hidden, the policy cannot tell. (Earlier versions fixed each
training row's match, one of the 2352 non-evaluation matches; before that, the secrets 3, 6, 9, 12 and 15
were held out entirely, and held-out success measured saying those numbers, not the strategy: see README.md.)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PROMPT = "Let's play higher or lower. Reply with just your guess."
# The game (interaction.yaml's env_kwargs and warm_start.py use the same): ROUNDS rounds, each a secret in
# LOW..HIGH found within GUESSES guesses.
LOW, HIGH, GUESSES, ROUNDS = 1, 7, 3, 4
N_TRAIN = 392  # training rows (seeds); a run of 16 steps x 8 rows uses 128 of them (data.seed picks which)


def evaluation_matches() -> list[tuple[int, ...]]:
    """49 matches, an orthogonal array of strength 2 over 7 symbols: every pair of rounds sees every pair once."""
    n = HIGH - LOW + 1
    return [tuple(LOW + (a + k * b) % n if k else LOW + a for k in range(ROUNDS))  # k = 0: a; k >= 1: a + k b
            for a in range(n) for b in range(n)]


def rows(split: str, matches: list[tuple[int, ...]] | None, n: int = 0) -> list[dict]:
    """One row per match (the secrets fixed), or with `matches` None, `n` rows that give only a seed: the env
    (random_secrets: true) then draws a new match for every trajectory."""
    kwargs = ([{"name": "hilo", "secrets": list(m), "seed": i} for i, m in enumerate(matches)] if matches is not None
              else [{"name": "hilo", "seed": i} for i in range(n)])
    return [{
        "data_source": "hilo",
        "prompt": [{"role": "user", "content": PROMPT}],
        "extra_info": {"split": split, "index": i, "interaction_kwargs": k},
    } for i, k in enumerate(kwargs)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "data"))
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for split, data in (("train", rows("train", None, N_TRAIN)), ("test", rows("test", evaluation_matches()))):
        (out / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in data))


if __name__ == "__main__":
    main()
