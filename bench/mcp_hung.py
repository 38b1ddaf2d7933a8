"""Issue 44, item 3: one MCP server SIGSTOPped mid-step of a training run, 128 trajectories a step.

    python bench/mcp_hung.py                       # both rows, 2 training steps each (~2-3 min on 2 CPU cores)
    python bench/mcp_hung.py --rows read_only --steps 1

Each row is `verl-agent train examples/calculator/config.yaml` (the tiny model, 8 prompts x 16 samples = 128
trajectories a step, 2 rollout workers under Ray on CPU) with the `calculator` tool served over MCP by
bench/mcp_calculator_server.py, one stdio server process per rollout worker (`server_scope: worker`). The server
that gets its --hang-at-th call first SIGSTOPs itself before answering it, during step 1: the calls in flight on
it and those sent to it after get no answer. The rows differ only in the tool's annotation:

* read_only: `readOnlyHint` (the MCP annotation for a tool safe to call again): a cut-off call runs again on
  the fresh server;
* unannotated: no hint: a cut-off call fails its trajectory as an infrastructure failure (`mcp_server_hung`).

Per row: trajectories of the steps, those failed as mcp_server_hung, the calls retried (rollout/mcp/retried),
tool calls, whether the run went on to its last step (trainer.max_infra_failure_fraction: 0.2) and the seconds.
Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
SERVER = ROOT / "bench" / "mcp_calculator_server.py"
ROWS = ("read_only", "unannotated")


def write_tools(folder: Path, row: str, hang_at: int, timeout: float) -> Path:
    """servers.json and the tool YAML of one row (verl's MCPBaseTool entry, the calculator only)."""
    env = {"MCP_BENCH_HANG_AT": str(hang_at), "MCP_BENCH_MARKER": str(folder / "hung.pid"),
           "MCP_BENCH_ANNOTATE": "1" if row == "read_only" else "0",
           "PYTHONPATH": str(ROOT)}
    servers = {"mcpServers": {"calc": {"command": sys.executable, "args": [str(SERVER)], "env": env}}}
    (folder / "servers.json").write_text(json.dumps(servers))
    entry = {"class_name": "verl.tools.mcp_base_tool.MCPBaseTool",
             "config": {"type": "mcp", "timeout": timeout, "rate_limit": 1000},
             "mcp": {"mcp_servers_config_path": "servers.json", "tool_selected_list": ["calculator"]}}
    path = folder / "tools.yaml"
    path.write_text(yaml.safe_dump({"tools": [entry]}))
    return path


def run_row(row: str, steps: int, hang_at: int, timeout: float, folder: Path) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    tools = write_tools(folder, row, hang_at, timeout)
    run_dir = folder / "run"
    cmd = [sys.executable, "-m", "verl_agent", "train", "examples/calculator/config.yaml",
           f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}",
           f"trainer.total_training_steps={steps}", "trainer.val_before_train=false", "data.val_files=[]",
           f"trainer.default_local_dir={run_dir}", "trainer.logger=[console]", "trainer.save_freq=-1",
           f"trainer.experiment_name=mcp_hung_{row}"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    (folder / "train.log").write_text(proc.stdout + proc.stderr)
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()] \
        if (run_dir / "metrics.jsonl").exists() else []
    steps_logged = [m for m in lines if "rollout/num_trajectories" in m]
    total = lambda key: int(sum(m.get(key, 0.0) for m in steps_logged))  # noqa: E731
    hung_pid = (folder / "hung.pid").read_text().strip() if (folder / "hung.pid").exists() else None
    stopped = next((line for line in (proc.stdout + proc.stderr).splitlines() if "max_infra_failure_fraction" in line),
                   None)
    return {
        "row": row, "steps": steps, "steps_logged": len(steps_logged), "trajectories": total("rollout/num_trajectories"),
        "failed_mcp_server_hung": total("rollout/infra_failed/mcp_server_hung"),
        "failed_infra": sum(int(v) for m in steps_logged for k, v in m.items() if k.startswith("rollout/infra_failed/")),
        "retried": total("rollout/mcp/retried"), "tool_calls": total("rollout/tool_calls_total"),
        "per_step": [{"trajectories": int(m["rollout/num_trajectories"]),
                      "failed_mcp_server_hung": int(m.get("rollout/infra_failed/mcp_server_hung", 0)),
                      "retried": int(m.get("rollout/mcp/retried", 0)), "tool_calls": int(m["rollout/tool_calls_total"]),
                      "success_rate": m.get("rollout/success_rate")} for m in steps_logged],
        "hung_server_pid": hung_pid,
        "run_continued": proc.returncode == 0 and len(steps_logged) == steps, "returncode": proc.returncode,
        "stop_message": stopped, "seconds": round(seconds, 1), "log": str(folder / "train.log"),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {ROWS}")
    ap.add_argument("--steps", type=int, default=2, help="training steps a row (the hang is in step 1)")
    ap.add_argument("--hang-at", type=int, default=8, help="the calculator call (of one server) that hangs it")
    ap.add_argument("--timeout", type=float, default=4.0, help="the MCP entry's config.timeout, s (the hang is "
                    "found within it: a probe after half of it)")
    ap.add_argument("--dir", type=Path, default=None, help="keep each row's files here (default: a temp dir)")
    args = ap.parse_args(argv)
    rows = [r for r in args.rows.split(",") if r]
    if set(rows) - set(ROWS):
        raise SystemExit(f"--rows: unknown {sorted(set(rows) - set(ROWS))}; choose from {ROWS}")
    base = args.dir or Path(tempfile.mkdtemp(prefix="mcp_hung_"))
    results = []
    for row in rows:
        results.append(run_row(row, args.steps, args.hang_at, args.timeout, base / row))
        r = results[-1]
        if r["hung_server_pid"] is None:
            print(f"warning: {row}: no server hung (fewer than {args.hang_at} calls to one server?)", file=sys.stderr)
    head = ("row", "trajectories", "failed mcp_server_hung", "retried", "tool calls", "run continued", "seconds")
    print(" | ".join(head))
    for r in results:
        print(" | ".join(str(x) for x in (r["row"], r["trajectories"], r["failed_mcp_server_hung"], r["retried"],
                                          r["tool_calls"], "yes" if r["run_continued"] else "no", r["seconds"])))
        if r["stop_message"]:
            print(f"  {r['row']}: {r['stop_message'].strip()}")
    print(json.dumps({"bench": "mcp_hung", "hang_at": args.hang_at, "timeout": args.timeout, "rows": results}))


if __name__ == "__main__":
    main()
