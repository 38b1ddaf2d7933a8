"""Draw held-out success vs step from trainer metrics files.

    python plot.py OUT.png RUN.metrics.jsonl ... [--title T] [--xlabel X] [--ylabel Y]
"""

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("out")
ap.add_argument("runs", nargs="+")
ap.add_argument("--title", default="SmolLM2-135M-Instruct, calculator task, one H200")
ap.add_argument("--xlabel", default="GRPO step (16 prompts x 16 samples)")
ap.add_argument("--ylabel", default="held-out success, % (256 problems)")
a = ap.parse_args()
fig, ax = plt.subplots(figsize=(6, 3.5))
for path in a.runs:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
    pts = sorted((r["step"], r["val/success_rate"]) for r in rows if "val/success_rate" in r)
    ax.plot([s for s, _ in pts], [100 * v for _, v in pts], marker="o", label=Path(path).name.split(".metrics")[0])
ax.set_xlabel(a.xlabel)
ax.set_ylabel(a.ylabel)
ax.set_title(a.title)
ax.grid(alpha=0.3)
ax.legend()
fig.tight_layout()
fig.savefig(a.out, dpi=120)
print(f"wrote {a.out}")
