"""``verl-agent tasks run | check | build-bases | reap | export | import`` (wired into verl_agent/cli.py).

``run TASK_DIR --agent oracle|nop|model [--model PATH_OR_URL]`` runs one Harbor task end to end and
prints a table and one JSON line (reward, outcome, timings). ``check DIR`` runs oracle and nop on
every task of a folder and lists each task whose oracle does not score 1 or whose nop does not
score 0 (exit code 1 then). ``build-bases`` builds the offline base images (verl_agent.tasks.bases).
``reap`` removes task containers left by dead runs on this host. ``--runtime docker|bwrap|auto`` picks the
container runtime of run, check and reap. ``export DIR --out BUNDLE`` writes every
task image of a folder as one bundle, and ``import BUNDLE`` loads it into the daemonless image store
(verl_agent.tasks.export).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

__all__ = ["add_cli", "run_cli"]


RUNTIME_HELP = "container runtime: docker, bwrap (no daemon), or auto (docker when a daemon answers)"


def add_cli(sub: Any) -> None:
    from verl_agent.containers import runtime_names

    p = sub.add_parser("tasks", help="Harbor tasks in containers: run, check, build-bases, reap, export, import",
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
    r.add_argument("--runtime", choices=runtime_names(), default="auto", help=RUNTIME_HELP)
    c = actions.add_parser("check", help="oracle must score 1 and nop 0 on every task of a folder")
    c.add_argument("folder", help="a folder of task directories (or one task directory)")
    c.add_argument("--jobs", type=int, default=4, help="tasks run at once")
    c.add_argument("--allow-internet", action="store_true", help="run tasks that ask for internet access")
    c.add_argument("--runtime", choices=runtime_names(), default="auto", help=RUNTIME_HELP)
    actions.add_parser("build-bases", help="build the offline base images (debian:bookworm-slim, python:3.12-slim)")
    rp = actions.add_parser("reap", help="remove task containers left behind by dead runs on this host")
    rp.add_argument("--runtime", choices=runtime_names(), default="auto", help=RUNTIME_HELP)
    e = actions.add_parser("export", help="build every task image of a folder and write one bundle for hosts "
                           "without Docker (images.tar.zst + index.json)")
    e.add_argument("folder", help="a folder of task directories (searched recursively), or one task directory")
    e.add_argument("--out", required=True, help="the bundle directory to write")
    e.add_argument("--level", type=int, default=19, help="zstd level of images.tar.zst (default 19)")
    i = actions.add_parser("import", help="load a bundle written by `tasks export` into the image store (no Docker)")
    i.add_argument("bundle_dir", help="a directory holding images.tar.zst and index.json")
    i.add_argument("--store", default=None, help="the image store (default $VERL_AGENT_IMAGES or "
                   "$VERL_AGENT_CACHE/images)")
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
                               runtime=args.runtime, **kwargs))
    _print_run(run)
    return 0 if run.outcome == "ok" else 1


def _check(args: argparse.Namespace) -> int:
    from verl_agent.data.harbor import TaskError
    from verl_agent.tasks.runner import check_tasks

    try:
        results = asyncio.run(check_tasks(args.folder, jobs=args.jobs, allow_internet=args.allow_internet,
                                          runtime=args.runtime))
    except TaskError as e:
        print(f"verl-agent tasks check: error: {e}", file=sys.stderr)
        return 2
    bad = []
    for d, oracle, nop in results:
        problems = _problems(oracle, nop)
        print(f"{'FAIL' if problems else 'ok  '}  {d}" + (f"  {'; '.join(p for p, _ in problems)}" if problems else ""))
        for _, run in problems:  # what the verifier said, for each run that went wrong
            _print_verifier(run)
        if problems:
            bad.append(d)
    summary = {"tasks": len(results), "failed": len(bad), "failed_tasks": bad}
    print(json.dumps(summary))
    return 1 if bad else 0


def _export(args: argparse.Namespace) -> int:
    from verl_agent.data.harbor import TaskError
    from verl_agent.tasks.export import export_tasks
    from verl_agent.tasks.image import ImageError

    try:
        res = export_tasks(args.folder, args.out, level=args.level)
    except (ImageError, TaskError) as e:
        print(f"verl-agent tasks export: error: {e}", file=sys.stderr)
        return 1
    names = {e["ref"]: e["tasks"] for e in res["tasks"].values()} | res["images"]
    print(_table([(ref, f"{len(names[ref])} task(s): {', '.join(names[ref][:3])}{' ...' * (len(names[ref]) > 3)}")
                  for ref in res["refs"]]))
    print(f"{res['archive']}: {res['archive_bytes'] / 2**20:.1f} MiB ({res['tar_bytes'] / 2**20:.1f} MiB as tar)")
    print(json.dumps({"refs": res["refs"], "archive_bytes": res["archive_bytes"], "tar_bytes": res["tar_bytes"],
                      "build_s": res["build_s"], "save_s": res["save_s"]}))
    return 0


def _import(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from verl_agent.containers.images import ImageStore, ImageStoreError, tree_bytes
    from verl_agent.tasks.export import import_bundle
    from verl_agent.tasks.image import ImageError

    store = ImageStore(Path(args.store) if args.store else None)
    t0 = time.perf_counter()
    try:
        refs = import_bundle(Path(args.bundle_dir), store)
    except (ImageError, ImageStoreError) as e:
        print(f"verl-agent tasks import: error: {e}", file=sys.stderr)
        return 1
    seconds = time.perf_counter() - t0
    seen: set = set()
    roots = {ref: store.get(ref).rootfs for ref in refs}  # type: ignore[union-attr]
    sizes = {ref: tree_bytes(root, seen) for ref, root in roots.items()}  # what each adds; shared layers once
    print(_table([(ref, f"rootfs {tree_bytes(roots[ref]) / 2**20:6.1f} MiB, {n / 2**20:5.1f} MiB of it not in "
                        "an image above") for ref, n in sizes.items()]))
    print(f"store {store.root}: {sum(sizes.values()) / 2**20:.1f} MiB for {len(refs)} image(s) ({seconds:.1f} s)")
    print(json.dumps({"refs": refs, "store": str(store.root), "bytes": sum(sizes.values()),
                      "image_bytes": sizes, "seconds": round(seconds, 2)}))
    return 0


def _problems(oracle: Any, nop: Any) -> list[tuple[str, Any]]:
    """(what is wrong, the run) for an oracle that does not score 1 and a nop that does not score 0."""
    problems = []
    if oracle.reward != 1:
        problems.append((f"oracle scored {oracle.reward}" + (f" ({oracle.cause}: {oracle.error})" if oracle.error
                                                            else ""), oracle))
    if nop.reward is None and nop.cause == "verifier_error":
        # the failing case of every trajectory: without a reward file each becomes an infrastructure failure,
        # left out of the loss, so only successes would train
        problems.append((f"nop run has no reward file ({nop.error}): test.sh must write 0 to "
                         "/logs/verifier/reward.txt when the tests fail, or every failing trajectory is an "
                         "infrastructure failure, left out of the loss", nop))
    elif nop.reward != 0:
        problems.append((f"nop scored {nop.reward}" + (f" ({nop.cause}: {nop.error})" if nop.error else ""), nop))
    return problems


def _print_verifier(run: Any) -> None:
    out = run.verifier_output.strip()
    text = "\n".join(f"      {line}" for line in out[-2000:].splitlines()) if out else \
        f"      (none kept: {run.error or 'the verifier printed nothing'})"
    print(f"    {run.agent} run, verifier output:\n{text}")


def run_cli(args: argparse.Namespace) -> int:
    if args.tasks_command == "run":
        return _run(args)
    if args.tasks_command == "check":
        return _check(args)
    if args.tasks_command == "build-bases":
        from verl_agent.tasks import bases  # provided beside this package: the offline base-image builder

        return int(bases.main([]) or 0)
    if args.tasks_command == "reap":
        from verl_agent.containers import get_runtime

        runtime = get_runtime(args.runtime)
        print(f"removed {runtime.reap()} task container(s) of dead runs ({runtime.name})")
        return 0
    if args.tasks_command == "export":
        return _export(args)
    if args.tasks_command == "import":
        return _import(args)
    raise SystemExit(f"unknown tasks action {args.tasks_command!r}")
