"""Write the calculator task's train/test splits (disjoint problems) as JSONL in simple row format."""

import argparse
from pathlib import Path

from verl_agent.models.calculator_task import write_calculator_data

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=str(Path(__file__).parent / "data"))
    ap.add_argument("--n-train", type=int, default=1024)
    ap.add_argument("--n-test", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    train, test = write_calculator_data(a.out, a.n_train, a.n_test, a.seed)
    print(f"wrote {train} and {test}")
