"""`verl-agent` command line: train | rollout | eval | model | sandbox | tasks | config | tools | view.

Each subcommand imports its machinery lazily so `--help` stays instant.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from verl_agent import __version__

if TYPE_CHECKING:
    from verl_agent.config import RunConfig
    from verl_agent.rollout.evaluation.evaluate import EvalModel
    from verl_agent.rollout.tool_budget import PromptBudget

EPILOG_OVERRIDES = (
    "Any config key can be overridden as key=value, e.g.\n"
    "  data.train_batch_size=8 actor_rollout_ref.actor.optim.lr=1e-6 trainer.logger=[console,tensorboard]\n"
    "`verl-agent config keys` lists every key."
)


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="run config YAML (optional: defaults + overrides also work)")
    p.add_argument("overrides", nargs="*", help="key=value overrides (dotted keys, verl names)")


def _split_config_arg(args: argparse.Namespace) -> tuple[str | None, list[str]]:
    """`verl-agent train a.b=1` (no YAML) must treat the first word as an override, not a file."""
    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config:
        return None, [config, *overrides]
    return config, overrides


def _cmd_train(args: argparse.Namespace) -> int:
    from verl_agent.config import load_config
    from verl_agent.trainer.loop import TrainingError, train
    from verl_agent.trainer.tracking.loggers import LoggerConfigError

    path, overrides = _split_config_arg(args)
    try:
        train(load_config(path, overrides))
    except (TrainingError, LoggerConfigError) as e:  # says the step, cause and checkpoint; or the logger's fix
        print(f"verl-agent: error: {e}", file=sys.stderr)
        return 1
    return 0


def _cmd_rollout(args: argparse.Namespace) -> int:
    from verl_agent.config import load_config
    from verl_agent.rollout.evaluation.evaluate import evaluate_cli

    path, overrides = _split_config_arg(args)
    return evaluate_cli(load_config(path, overrides), split=args.split, out=args.out)


def _eval_model(spec: str, args: argparse.Namespace) -> EvalModel:
    """--model: an http(s) URL (OpenAI-compatible), a trainer checkpoint or run dir, else a HF folder/id."""
    from pathlib import Path

    from verl_agent.rollout.evaluation.evaluate import EvalModel

    if spec.startswith(("http://", "https://")):
        import os

        key = args.api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
        return EvalModel(spec, url=spec, served_name=args.served_model_name, api_key=key)
    path = Path(spec)
    if (path / "complete.json").exists() or (path / "checkpoints").is_dir():
        from verl_agent.trainer.persistence.checkpoint import load_checkpoint_model, resolve_checkpoint

        ckpt = resolve_checkpoint(path)  # before any rollout: a bad path fails at once
        return EvalModel(spec, load=lambda: load_checkpoint_model(ckpt))
    return EvalModel(spec, model=spec)


def _cmd_eval(args: argparse.Namespace) -> int:
    from pathlib import Path

    from verl_agent.config import load_config
    from verl_agent.rollout.evaluation.evaluate import EvalModel, format_table, run_eval

    path, overrides = _split_config_arg(args)
    cfg = load_config(path, overrides)
    n = args.n or max(args.k, cfg.actor_rollout_ref.rollout.val_kwargs.n)
    try:
        models = [_eval_model(m, args) for m in args.model] or [EvalModel(cfg.actor_rollout_ref.model.path,
                                                                          model=cfg.actor_rollout_ref.model.path)]
        out = Path(args.out) if args.out else cfg.run_dir / "eval"
        result = run_eval(cfg, models, k=args.k, n=n, out_dir=out)
    except (ValueError, FileNotFoundError, ConnectionError) as e:
        print(f"verl-agent eval: error: {e}", file=sys.stderr)
        return 2
    print(format_table(result))
    print(f"result: {out / 'result.json'}   trajectories: {', '.join(m['trajectories'] for m in result['models'])}")
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    import yaml

    from verl_agent.config import all_keys, load_config

    if args.action == "keys":
        print("\n".join(all_keys()))
        return 0
    path, overrides = _split_config_arg(args)
    print(yaml.safe_dump(load_config(path, overrides).model_dump(), sort_keys=False), end="")
    return 0


def _tool_source(tool: object) -> str:
    server = getattr(tool, "server", None)
    if server is not None and hasattr(server, "spec"):  # an MCP tool
        spec = server.spec
        return f"MCP server {server.name!r} ({spec.url or ' '.join([spec.command or '', *spec.args])})"
    fn = getattr(tool, "fn", None)
    obj = fn if fn is not None else type(tool)
    where = f"{obj.__module__}.{obj.__qualname__}"
    if obj.__module__.startswith("_verl_agent_user_"):  # loaded from a file path: name the file
        import inspect
        import os

        where = f"{os.path.relpath(inspect.getfile(obj))}:{obj.__qualname__}"
    return f"@tool {where}" if fn is not None else where


def _cmd_tools(args: argparse.Namespace) -> int:
    """Every tool of a tool YAML, or of the run config that names one, with its schema (and, for a run config,
    its size in prompt tokens)."""
    import asyncio
    import json
    from pathlib import Path

    import yaml

    from verl_agent.tools import load_tools

    path, overrides = _split_config_arg(args)
    data = yaml.safe_load(Path(path).read_text()) if path else None
    cfg: RunConfig | None = None
    if isinstance(data, dict) and "tools" in data and not overrides:  # a tool YAML itself
        tool_yaml: str | None = path
    else:
        from verl_agent.config import load_config

        cfg = load_config(path, overrides)
        tool_yaml = cfg.actor_rollout_ref.rollout.multi_turn.tool_config_path
    tools = load_tools(tool_yaml)
    try:
        schemas = {name: t.get_openai_tool_schema().to_openai() for name, t in tools.items()}
        budget = _tool_budget(cfg, schemas) if cfg is not None and tools else None
        if args.json:
            print(json.dumps(list(schemas.values()), indent=2))
        for name, tool in tools.items() if not args.json else ():
            fn = schemas[name]["function"]
            size = f", {budget.per_tool[name]} prompt tokens" if budget is not None else ""
            print(f"{name}  [{_tool_source(tool)}{size}]")
            if fn.get("description"):
                print(f"  {fn['description']}")
            print(f"  parameters: {json.dumps(fn['parameters'], ensure_ascii=False)}")
        if budget is not None:
            _print_budget(budget, cfg.actor_rollout_ref.model.tokenizer_path or cfg.actor_rollout_ref.model.path,
                          quiet=args.json)
        if not tools:
            print(f"no tools ({tool_yaml or 'actor_rollout_ref.rollout.multi_turn.tool_config_path is not set'})",
                  file=sys.stderr)
    finally:
        for tool in tools.values():  # MCP servers the listing started
            asyncio.run(tool.shutdown())
    return 0


def _tool_budget(cfg: RunConfig, schemas: dict[str, dict]) -> PromptBudget:
    from verl_agent.rollout.build import load_tokenizer
    from verl_agent.rollout.tool_budget import prompt_budget

    return prompt_budget(cfg, load_tokenizer(cfg.actor_rollout_ref.model), schemas)


def _print_budget(b: PromptBudget, tokenizer: str, quiet: bool) -> None:
    """The tool block's size, the longest prompt with it, and a warning where prompts would not fit."""
    from verl_agent.rollout.tool_budget import SCAN_LIMIT

    if not quiet:
        print(f"tool block: {b.block} prompt tokens ({tokenizer}'s chat template); longest prompt with it: "
              f"{b.longest} tokens ({b.longest_uid}) of data.max_prompt_length={b.limit}, over {b.scanned} prompts "
              f"(at most {SCAN_LIMIT} per file)")
    if b.over:
        print(f"warning: with the tool block ({b.block} tokens), {b.over} of {b.scanned} prompts exceed "
              f"data.max_prompt_length={b.limit} (longest: {b.longest} tokens, {b.longest_uid}); each would end as "
              f"prompt_too_long. Raise data.max_prompt_length to {b.longest} or select fewer tools "
              "(MCP: mcp.tool_selected_list)", file=sys.stderr)


def _cmd_view(args: argparse.Namespace) -> int:
    from verl_agent.rollout.records import print_records

    if args.serve or args.html:
        from verl_agent.viewer import RunError, serve, write_report

        try:
            if args.html:
                print(f"verl-agent view: wrote {write_report(args.path, args.html)}")
            if args.serve:
                serve(args.path, host=args.host, port=args.port)
        except RunError as e:
            print(f"verl-agent view: error: {e}", file=sys.stderr)
            return 2
        return 0
    try:
        print_records(args.path, limit=args.limit, only_failed=args.failed)
    except FileNotFoundError:
        print(f"verl-agent view: error: {args.path}: no such file (a run writes <run dir>/trajectories/step_N.jsonl)",
              file=sys.stderr)
        return 2
    except (ValueError, UnicodeDecodeError, IsADirectoryError) as e:
        print(f"verl-agent view: error: {e}", file=sys.stderr)
        return 2
    return 0


def _add_tools_cli(sub: argparse._SubParsersAction, fmt: type[argparse.HelpFormatter]) -> None:
    p = sub.add_parser("tools", help="list every tool of a config (YAML classes, @tool functions, MCP servers)",
                       epilog=EPILOG_OVERRIDES, formatter_class=fmt,
                       description="Load the tools of a tool YAML, or of a run config's multi_turn.tool_config_path "
                       "(MCP servers are started and listed), and print each with its schema. With a run config, "
                       "also each tool's size in prompt tokens (the configured tokenizer's chat template) and a "
                       "warning when the tool block plus the longest prompt exceeds data.max_prompt_length.")
    p.add_argument("action", choices=["list"], help="list: every tool with its schema")
    _add_config_args(p)
    p.add_argument("--json", action="store_true", help="print the OpenAI tool schemas as one JSON list")
    p.set_defaults(func=_cmd_tools)


def _add_eval_cli(sub: argparse._SubParsersAction, fmt: type) -> None:
    """`verl-agent eval CONFIG [--k K] [--n N] [--model M ...]`."""
    p = sub.add_parser("eval", help="pass@1, pass@k, maj@k on the held-out data (one column per --model)",
                       epilog=EPILOG_OVERRIDES, formatter_class=fmt,
                       description="Roll out data.val_files with n samples per prompt (sampling: rollout.val_kwargs) "
                       "and print pass@1, pass@k (Chen et al. 2021), maj@k, mean reward and outcome counts per "
                       "data_source; writes <out>/result.json and the trajectories.")
    _add_config_args(p)
    p.add_argument("--k", type=int, default=1, help="k of pass@k and maj@k (default 1)")
    p.add_argument("--n", type=int, default=None, help="samples per prompt (>= k; default max(k, val_kwargs.n))")
    p.add_argument("--model", action="append", default=[], metavar="MODEL",
                   help="a HF folder or id, a trainer checkpoint (global_step_N) or run dir, or an OpenAI-compatible "
                   "base URL (http://host:port/v1); repeat to compare (default: actor_rollout_ref.model.path)")
    p.add_argument("--served-model-name", default=None, help="with a URL: the model to ask for (default: the "
                   "first the server lists)")
    p.add_argument("--api-key", default=None, help="with a URL: the API key (default: $OPENAI_API_KEY)")
    p.add_argument("--out", default=None, help="output dir (default: <run dir>/eval)")
    p.set_defaults(func=_cmd_eval)


def _add_model_cli(sub: argparse._SubParsersAction) -> None:
    """`verl-agent model build-tiny | build-smollm2 | check-template`."""
    from verl_agent.models.check_template import add_cli as add_check_template_cli
    from verl_agent.models.smollm2 import add_cli as add_smollm2_cli
    from verl_agent.models.tiny import add_cli as add_model_cli

    p = sub.add_parser("model", help="build the embedded tiny model or SmolLM2; check a chat template",
                       description="Model utilities.")
    actions = p.add_subparsers(dest="model_command", metavar="ACTION", required=True)
    add_model_cli(actions)
    add_smollm2_cli(actions)
    add_check_template_cli(actions)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="verl-agent",
        description="Train LLM agents with multi-turn reinforcement learning.",
        epilog="Start with `make demo`, or `verl-agent train examples/calculator/config.yaml`.",
    )
    parser.add_argument("--version", action="version", version=f"verl-agent {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    fmt = argparse.RawDescriptionHelpFormatter

    p = sub.add_parser("train", help="train a policy with GRPO/PPO", epilog=EPILOG_OVERRIDES, formatter_class=fmt,
                       description="Run RL training: rollouts -> advantages -> FSDP update -> weight sync, per step.")
    _add_config_args(p)
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("rollout", help="run rollouts only (evaluation)", epilog=EPILOG_OVERRIDES,
                       formatter_class=fmt, description="Roll out the policy on a dataset and report success, "
                       "reward and turn/tool statistics; trajectories are written as JSONL.")
    _add_config_args(p)
    p.add_argument("--split", choices=["val", "train"], default="val", help="which data files to use")
    p.add_argument("--out", default=None, help="trajectory JSONL path (default: <run dir>/rollout.jsonl)")
    p.set_defaults(func=_cmd_rollout)

    _add_eval_cli(sub, fmt)

    _add_model_cli(sub)
    from verl_agent.sandbox.cli import add_cli as add_sandbox_cli
    from verl_agent.sandbox.cli import run_cli as run_sandbox_cli

    add_sandbox_cli(sub)
    sub.choices["sandbox"].set_defaults(func=run_sandbox_cli)
    from verl_agent.tasks.cli import add_cli as add_tasks_cli

    add_tasks_cli(sub)

    p = sub.add_parser("config", help="show the resolved config or list all keys", epilog=EPILOG_OVERRIDES,
                       formatter_class=fmt)
    p.add_argument("action", choices=["show", "keys"], help="show: resolved YAML; keys: every valid key")
    _add_config_args(p)
    p.set_defaults(func=_cmd_config)

    _add_tools_cli(sub, fmt)

    p = sub.add_parser("view", help="print trajectory records, or browse a run in the browser (--serve/--html)")
    p.add_argument("path", help="a trajectories .jsonl file written by train/rollout (or, with --serve/--html, a run dir)")
    p.add_argument("--limit", type=int, default=5, help="records to show")
    p.add_argument("--failed", action="store_true", help="only trajectories with reward <= 0")
    p.add_argument("--serve", action="store_true", help="serve the run viewer (curves, trajectories, tokens)")
    p.add_argument("--port", type=int, default=8265, help="port for --serve")
    p.add_argument("--host", default="127.0.0.1", help="address for --serve (0.0.0.0 to share on the network)")
    p.add_argument("--html", metavar="FILE", help="write the viewer as one self-contained HTML file")
    p.set_defaults(func=_cmd_view)
    return parser


def _innermost(parser: argparse.ArgumentParser, args: argparse.Namespace,
               words: list[str]) -> tuple[argparse.ArgumentParser, list[str]]:  # fmt: skip
    """The parser of the (sub)subcommand `args` chose, and the words after its name."""
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        name = getattr(args, subs[0].dest, None) if subs else None
        if name is None or name not in words:
            return parser, words
        words = words[words.index(name) + 1 :]
        parser = subs[0].choices[name]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line as users type it: options before or after positionals, key=value overrides anywhere."""
    parser = build_parser()
    words = list(sys.argv[1:] if argv is None else argv)
    args, rest = parser.parse_known_args(words)
    if rest:  # options before positionals (`tools list --json FILE`): argparse matches positionals in one run
        sub, tail = _innermost(parser, args, words)
        for action in sub._actions:  # its arguments are parsed again, from scratch (append actions included)
            if hasattr(args, action.dest):
                delattr(args, action.dest)
        args, rest = sub.parse_known_intermixed_args(tail, namespace=args)
    # key=value overrides may also follow an option (`rollout c.yaml --split train a=1`): argparse leaves
    # positionals after an option unmatched; anything else unknown is still an error
    if rest and hasattr(args, "overrides") and all("=" in a and not a.startswith("-") for a in rest):
        args.overrides = [*args.overrides, *rest]
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    from verl_agent.config import ConfigError
    from verl_agent.data import DataError
    from verl_agent.interactions.errors import InteractionConfigError
    from verl_agent.reward import RewardError
    from verl_agent.tools.errors import ToolConfigError

    try:
        return int(args.func(args) or 0)
    except (ConfigError, DataError, RewardError, ToolConfigError, InteractionConfigError) as e:
        print(f"verl-agent: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
