"""Write the corpus and the questions: data/corpus.jsonl, data/train.jsonl, data/test.jsonl.

    python examples/search_agent/make_data.py

The corpus describes made-up towns of the made-up Velmar Islands, so no model can
answer from memory: it has to search. Questions are one-hop ("When was Brask
founded?"), two-hop ("Which river flows through the town Ada Korrin founded?")
and comparisons ("Which was founded first, Brask or Tulm?"); the last two need
two searches, which a good policy issues in one turn.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

TOWNS = ["Brask", "Tulm", "Orvik", "Selda", "Kaim", "Veshold", "Dunmere", "Pell", "Aros", "Lisk", "Marrow", "Quen"]
FIRST = ["Ada", "Bram", "Cora", "Dain", "Esk", "Fenna", "Gil", "Hale", "Ines", "Jory", "Kell", "Lune"]
LAST = ["Korrin", "Vast", "Amsel", "Droon", "Hollis", "Pike", "Ternow", "Ulver", "Wick", "Yarrow", "Zell", "Mott"]
RIVERS = ["Olen", "Saar", "Tamm", "Ivel", "Rhee", "Cask"]
GOODS = ["salt", "amber", "wool", "herring", "slate", "honey", "rope", "glass"]
SYSTEM = ("Answer questions about the Velmar Islands. Use the search tool; you may call it several times, "
          "also in one turn. Give the final answer as <answer>...</answer>.")


def world(seed: int) -> list[dict]:
    rng = random.Random(f"velmar-{seed}")
    firsts, lasts = rng.sample(FIRST, len(TOWNS)), rng.sample(LAST, len(TOWNS))
    years = rng.sample(range(1100, 1700), len(TOWNS))
    return [{"town": t, "founder": f"{f} {s}", "year": y, "river": rng.choice(RIVERS),
             "good": rng.choice(GOODS)} for t, f, s, y in zip(TOWNS, firsts, lasts, years)]


def corpus(towns: list[dict]) -> list[dict]:
    docs = []
    for t in towns:
        docs.append({"id": f"town-{t['town']}", "title": t["town"],
                     "text": f"{t['town']} is a town of the Velmar Islands, founded in {t['year']} by {t['founder']}. "
                             f"The {t['river']} river flows through {t['town']}, which is known for its {t['good']}."})
        docs.append({"id": f"person-{t['founder']}", "title": t["founder"],
                     "text": f"{t['founder']} was a Velmar shipwright and explorer who founded the town of "
                             f"{t['town']}."})
    return docs


def questions(towns: list[dict], rng: random.Random) -> list[tuple[str, str, str]]:
    """(kind, question, answer) for every town and pair of towns, shuffled."""
    qs = []
    for t in towns:
        qs.append(("one_hop", f"In which year was {t['town']} founded?", str(t["year"])))
        qs.append(("one_hop", f"What is {t['town']} known for?", t["good"]))
        qs.append(("two_hop", f"Which river flows through the town founded by {t['founder']}?", t["river"]))
    for a, b in zip(towns, towns[1:] + towns[:1]):
        first = a if a["year"] < b["year"] else b
        qs.append(("compare", f"Which town was founded first, {a['town']} or {b['town']}?", first["town"]))
    rng.shuffle(qs)
    return qs


def row(kind: str, q: str, answer: str, split: str, i: int) -> dict:
    return {"data_source": f"velmar_{kind}",
            "prompt": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": split, "index": i, "kind": kind}}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).parent / "data"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-test", type=int, default=12)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    towns = world(args.seed)
    (out / "corpus.jsonl").write_text("".join(json.dumps(d) + "\n" for d in corpus(towns)))
    qs = questions(towns, random.Random(f"velmar-q-{args.seed}"))
    splits = {"test": qs[: args.n_test], "train": qs[args.n_test :]}
    for split, items in splits.items():
        (out / f"{split}.jsonl").write_text("".join(json.dumps(row(*q, split, i)) + "\n" for i, q in enumerate(items)))


if __name__ == "__main__":
    main()
