"""Draw held-out success vs step from trainer metrics files: python plot.py OUT.png RUN.metrics.jsonl ..."""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

out, *runs = sys.argv[1:]
fig, ax = plt.subplots(figsize=(6, 3.5))
for path in runs:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
    pts = sorted((r["step"], r["val/success_rate"]) for r in rows if "val/success_rate" in r)
    ax.plot([s for s, _ in pts], [100 * v for _, v in pts], marker="o", label=Path(path).name.split(".metrics")[0])
ax.set_xlabel("GRPO step (16 prompts x 16 samples)")
ax.set_ylabel("held-out success, % (256 problems)")
ax.set_title("SmolLM2-135M-Instruct, calculator task, one H200")
ax.grid(alpha=0.3)
ax.legend()
fig.tight_layout()
fig.savefig(out, dpi=120)
print(f"wrote {out}")
