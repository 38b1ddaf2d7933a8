"""``verl-agent tasks run | check | build-bases | reap`` (wired into verl_agent/cli.py).

``run TASK_DIR --agent oracle|nop|model [--model PATH_OR_URL]`` runs one Harbor task end to end and
prints a table and one JSON line (reward, outcome, timings). ``check DIR`` runs oracle and nop on
every task of a folder and lists each task whose oracle does not score 1 or whose nop does not
score 0 (exit code 1 then). ``build-bases`` builds the offline base images (verl_agent.tasks.bases).
``reap`` removes task containers left by dead runs on this host.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

__all__ = ["add_cli", "run_cli"]


def add_cli(sub: Any) -> None:
    p = sub.add_parser("tasks", help="Harbor tasks in containers: run, check, build-bases, reap",
                       description="Harbor-format tasks: one container per trajectory, graded by the task's tests.")
    actions = p.add_subparsers(dest="tasks_command", metavar="ACTION", required=True)
    r = actions.add_parser("run", help="run one task end to end and print its reward and timings")
    r.add_argument("task_dir", help="a Harbor task directory (task.toml, instruction.md, environment/, tests/)")
    r.add_argument("--agent", choices=["oracle", "nop", "model"], default="oracle",
                   help="oracle: run solution/solve.sh; nop: do nothing; model: the agent loop")
    r.add_argument("--model", default=None, help="--agent model: a local model path (or tiny/smollm2), or an "
                   "OpenAI-compatible base URL (http://host:port/v1)")
    r.add_argument("--served-model-name", default=None, help="the model name to send to an OpenAI URL")
    r.add_argument("--max-turns", type=int, default=20, help="--agent model: assistant turns at most")
    r.add_argument("--allow-internet", action="store_true", help="run a task that asks for internet access")
    c = actions.add_parser("check", help="oracle must score 1 and nop 0 on every task of a folder")
    c.add_argument("folder", help="a folder of task directories (or one task directory)")
    c.add_argument("--jobs", type=int, default=4, help="tasks run at once")
    c.add_argument("--allow-internet", action="store_true", help="run tasks that ask for internet access")
    actions.add_parser("build-bases", help="build the offline base images (debian:bookworm-slim, python:3.12-slim)")
    actions.add_parser("reap", help="remove task containers left behind by dead runs on this host")
    p.set_defaults(func=run_cli)


def _table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _print_run(run: Any) -> None:
    rows = [("task", run.task), ("agent", run.agent),
            ("reward", "-" if run.reward is None else f"{run.reward:g}"), ("outcome", run.outcome)]
    if run.cause:
        rows.append(("cause", run.cause))
    rows += [(k, f"{v:.3f}") for k, v in run.timings.items()]
    rows.append(("image", f"{run.image} ({'built' if run.image_built else 'cached'})"))
    rows += [(f"metric {k}", f"{v:g}") for k, v in run.metrics.items()]
    print(_table(rows))
    if run.error:
        print(f"error: {run.error}", file=sys.stderr)
    print(json.dumps(run.to_json()))


def _run(args: argparse.Namespace) -> int:
    from verl_agent.tasks.runner import run_task

    kwargs = {"max_turns": args.max_turns, "served_model_name": args.served_model_name} if args.agent == "model" else {}
    if args.agent == "model" and not args.model:
        print("verl-agent tasks run: error: --agent model needs --model PATH_OR_URL", file=sys.stderr)
        return 2
    run = asyncio.run(run_task(args.task_dir, args.agent, model=args.model, allow_internet=args.allow_internet,
                               **kwargs))
    _print_run(run)
    return 0 if run.outcome == "ok" else 1


def _check(args: argparse.Namespace) -> int:
    from verl_agent.tasks.runner import check_tasks
    from verl_agent.data.harbor import TaskError

    try:
        results = asyncio.run(check_tasks(args.folder, jobs=args.jobs, allow_internet=args.allow_internet))
    except TaskError as e:
        print(f"verl-agent tasks check: error: {e}", file=sys.stderr)
        return 2
    bad = []
    for d, oracle, nop in results:
        problems = []
        if oracle.reward != 1:
            problems.append(f"oracle scored {oracle.reward}" + (f" ({oracle.cause}: {oracle.error})" if oracle.error
                                                               else ""))
        if nop.reward != 0:
            problems.append(f"nop scored {nop.reward}" + (f" ({nop.cause}: {nop.error})" if nop.error else ""))
        print(f"{'FAIL' if problems else 'ok  '}  {d}" + (f"  {'; '.join(problems)}" if problems else ""))
        if problems:
            bad.append(d)
    summary = {"tasks": len(results), "failed": len(bad), "failed_tasks": bad}
    print(json.dumps(summary))
    return 1 if bad else 0


def run_cli(args: argparse.Namespace) -> int:
    if args.tasks_command == "run":
        return _run(args)
    if args.tasks_command == "check":
        return _check(args)
    if args.tasks_command == "build-bases":
        from verl_agent.tasks import bases  # provided beside this package: the offline base-image builder

        return int(bases.main([]) or 0)
    if args.tasks_command == "reap":
        import docker

        from verl_agent.tasks.container import reap

        print(f"removed {reap(docker.from_env())} task container(s) of dead runs")
        return 0
    raise SystemExit(f"unknown tasks action {args.tasks_command!r}")
