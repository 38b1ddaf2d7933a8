"""Viewer load time on a large step file (not a test): prints a table and one JSON line.

Writes a run whose trajectories/step_1.jsonl holds N trajectories of T tokens (default 10,000 x 4,096:
1,024 prompt + 3,072 response tokens over 3 tool-calling turns, with per-token advantages, ~1.1 GB), in the
exact layout of `records.trajectory_record`, then times the viewer on it through its HTTP API (FastAPI TestClient,
fresh app = nothing cached in the process; the file itself is in the OS page cache, as right after
the trainer wrote it). Target: the first page of the step browser in under 2 s.

    .venv/bin/python bench/viewer.py [--records 10000] [--tokens 4096] [--dir /tmp/verl-agent-bench-viewer] [--cold]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

from fastapi.testclient import TestClient

from verl_agent.protocol import Message, ToolCall, Trajectory, Turn
from verl_agent.rollout.records import trajectory_record
from verl_agent.viewer import Run, create_app

OUTCOMES = [("ok", None, 1.0), ("policy_failure", "wrong_answer", 0.0), ("infra_failure", "tool_timeout", 0.0),
            ("policy_failure", "budget_exhausted", 0.0)]  # fmt: skip


def _template(tokens: int, variant: int, rng: random.Random) -> str:
    """One record as a JSON line with a placeholder uid; realistic sizes for ids, masks, texts."""
    n_prompt, n_resp, turns = tokens // 4, tokens - tokens // 4, 3
    per = n_resp // turns
    ids = [rng.randrange(3, 500) for _ in range(n_resp)]
    mask, lps, tl = [], [], []
    for k in range(turns):
        gen = per * 2 // 3
        mask += [1] * gen + [0] * (per - gen)
        lps += [round(-rng.random() * 2, 5) for _ in range(gen)] + [0.0] * (per - gen)
        tl.append(Turn(k * per, k * per + gen, (k + 1) * per, num_tool_calls=1, score=0.1))
    ids = ids[: len(mask)]
    words = " ".join(f"word{rng.randrange(1000)}" for _ in range(per // 2))
    msgs = [Message("user", f"Task {variant}: " + words[:2000])]
    for k in range(turns):
        msgs.append(Message("assistant", words, tool_calls=[ToolCall("python", {"code": f"print({k})"}, id=f"c{k}")]))
        msgs.append(Message("tool", words[:1500], tool_call_id=f"c{k}", name="python"))
    outcome, cause, reward = OUTCOMES[variant % len(OUTCOMES)]
    traj = Trajectory("@UID@", [rng.randrange(3, 500) for _ in range(n_prompt)], ids, mask, lps, reward=reward,
                      turns=tl, messages=msgs, outcome=outcome, cause=cause)  # fmt: skip
    rec = trajectory_record(traj, step=1)
    # the trainer's per-token advantages (records.py): one float per response token, 0.0 off the loss mask
    adv = round(rng.uniform(-2, 2), 4)
    rec["advantages"] = [adv if m else 0.0 for m in mask]
    rec["prompt_text"], rec["response_text"] = words * 2, words * 3  # as if decoded by a tokenizer
    return json.dumps(rec, ensure_ascii=False)


def make_run(root: Path, n: int, tokens: int) -> Path:
    path = root / "trajectories" / "step_1.jsonl"
    stamp = root / f".done-{n}-{tokens}-adv"
    if stamp.exists():
        return root
    rng = random.Random(0)
    templates = [_template(tokens, v, rng) for v in range(8)]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for i in range(n):
            f.write(templates[i % len(templates)].replace("@UID@", f"data.jsonl:{i // 8}", 1) + "\n")
    (root / "config.yaml").write_text("actor_rollout_ref:\n  model:\n    path: tiny\n")  # tokens get decoded
    (root / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "rollout/reward/mean": s / 100}) + "\n"
                                                for s in range(1, 201)))  # fmt: skip
    stamp.touch()
    return root


def until_complete(get):
    """What the page does while a big file is still being indexed: ask again until it is complete."""
    while not (out := get("/api/records", file="step_1"))["complete"]:
        pass
    return out


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=10_000)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--dir", default="/tmp/verl-agent-bench-viewer")
    ap.add_argument("--cold", action="store_true", help="evict the step file from the page cache first (fadvise)")
    args = ap.parse_args()
    gen_s, root = timed(lambda: make_run(Path(args.dir), args.records, args.tokens))
    step_file = root / "trajectories" / "step_1.jsonl"
    size = step_file.stat().st_size
    if args.cold:  # only this file's pages: other processes on the machine keep their cache
        with step_file.open("rb") as f:
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    client = TestClient(create_app(Run(root)))
    get = lambda url, **p: client.get(url, params=p).json()
    rows = []
    for name, fn in [
        ("page load: /api/run + /api/metrics", lambda: (get("/api/run"), get("/api/metrics"))),
        ("first page: index (budgeted) + 50 rows", lambda: get("/api/records", file="step_1")),
        ("rest of the index (page re-asks)", lambda: until_complete(get)),
        ("next page (offset 5000)", lambda: get("/api/records", file="step_1", offset=5000)),
        ("filter outcome=infra_failure", lambda: get("/api/records", file="step_1", status="infra_failure")),
        ("open one record (4k tokens)", lambda: get("/api/record", file="step_1", index=4321)),
        ("tool names (all messages parsed)", lambda: get("/api/tools", file="step_1")),
        ("text search (details cached)", lambda: get("/api/records", file="step_1", text="word17 ")),
    ]:
        secs, out = timed(fn)
        rows.append({"op": name, "seconds": round(secs, 3)})
        if name.startswith("rest"):
            assert out["total"] == args.records, out.get("total")
    load = rows[0]["seconds"] + rows[1]["seconds"]
    full = load + rows[2]["seconds"]
    print(f"file: {args.records} trajectories x {args.tokens} tokens, {size / 1e6:.0f} MB (written in {gen_s:.1f} s)")
    print(f"{'operation':40} {'seconds':>8}")
    for r in rows:
        print(f"{r['op']:40} {r['seconds']:>8.3f}")
    print(f"{'LOAD (page + first page)':40} {load:>8.3f}   target < 2 s: {'OK' if load < 2 else 'MISSED'}")
    print(f"{'all records indexed':40} {full:>8.3f}")
    print(json.dumps({"bench": "viewer", "cold": args.cold, "records": args.records, "tokens": args.tokens, "file_mb": round(size / 1e6),
                      "load_seconds": round(load, 3), "full_index_seconds": round(full, 3), "target_met": load < 2, "results": rows}))  # fmt: skip


if __name__ == "__main__":
    main()
