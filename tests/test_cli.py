"""The `verl-agent` command line: help at every level, config errors, and the verl quick-start run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from verl_agent.cli import main
from verl_agent.tools import load_tools

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("argv", [[], ["train"], ["rollout"], ["model"], ["model", "build-tiny"], ["sandbox"],
                                  ["sandbox", "serve"], ["config"], ["tools"], ["view"]])
def test_help_at_every_level(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    assert e.value.code == 0
    assert "usage: verl-agent" in capsys.readouterr().out


def test_python_dash_m_entry_point():
    out = subprocess.run([sys.executable, "-m", "verl_agent", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.startswith("verl-agent ")


def test_config_show_and_keys(capsys):
    assert main(["config", "show", "data.train_batch_size=3", "trainer.logger=console"]) == 0
    shown = capsys.readouterr().out
    assert "train_batch_size: 3" in shown and "- console" in shown
    assert main(["config", "keys"]) == 0
    assert "actor_rollout_ref.rollout.multi_turn.max_assistant_turns" in capsys.readouterr().out.split()


def test_config_error_exits_2_with_hint(capsys):
    assert main(["config", "show", "data.train_bach_size=3"]) == 2
    assert "did you mean 'data.train_batch_size'" in capsys.readouterr().err


def test_tool_config_error_exits_2_without_traceback(capsys, monkeypatch, tiny_model_path):
    """A tool file that does not exist is a user error (exit 2, one line naming the file), not a crash; overrides
    may follow an option."""
    monkeypatch.chdir(ROOT)
    assert main(["rollout", "examples/calculator/config.yaml", "--split", "val", "data.val_batch_size=2",
                 "actor_rollout_ref.rollout.multi_turn.tool_config_path=/nope/tools.yaml"]) == 2  # after an option too
    err = capsys.readouterr().err
    assert "verl-agent: error: /nope/tools.yaml: cannot read" in err and "Traceback" not in err
    with pytest.raises(SystemExit):  # an unknown option is still refused
        main(["config", "show", "--bogus"])
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_a_logger_that_cannot_open_fails_train_in_one_line_before_ray(capsys, monkeypatch, tmp_path, tiny_model_path):
    """`verl-agent train` with MLflow's refused file store: one line with the fix, exit 1, no traceback."""
    pytest.importorskip("mlflow")
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    assert main(["train", "examples/calculator/config.yaml", "trainer.logger=[console,mlflow]",
                 f"trainer.default_local_dir={tmp_path / 'ckpt'}"]) == 1
    err = capsys.readouterr().err
    assert "verl-agent: error: trainer.logger=mlflow" in err and "MLFLOW_ALLOW_FILE_STORE=true" in err
    assert "Traceback" not in err


@pytest.mark.slow
def test_verl_quickstart_command_line_trains(tmp_path, tiny_model_path):
    """The quick-start command from the verl articles, run from examples/quickstart, 2 real GRPO steps.

    Ray's temp dir holds a stale `ray_current_cluster` (as a dead cluster leaves it): the trainer must
    start its own local Ray instead of waiting minutes for that cluster's GCS.
    """
    cmd = [str(Path(sys.executable).with_name("verl-agent")), "train",
           "actor_rollout_ref.model.path=tiny", "data.train_file=data/math_sample.jsonl",
           "data.reward_fn=reward_fn.math_reward_fn", "data.max_prompt_length=64", "data.max_response_length=32",
           "data.train_batch_size=3", "actor_rollout_ref.actor.ppo_mini_batch_size=3",
           "actor_rollout_ref.rollout.n=4", "trainer.total_training_steps=2", "trainer.val_before_train=False",
           f"trainer.default_local_dir={tmp_path}"]
    ray_tmp = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))  # short: Unix socket paths max 107 bytes
    (ray_tmp / "ray").mkdir()
    (ray_tmp / "ray" / "ray_current_cluster").write_text("127.0.0.1:9")  # nothing listens there
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_TMPDIR": str(ray_tmp)}
    try:
        out = subprocess.run(cmd, cwd=ROOT / "examples" / "quickstart", capture_output=True, text=True, env=env,
                             timeout=300)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert out.returncode == 0, out.stderr[-3000:]
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train_steps = [s for s in steps if "rollout/reward/mean" in s]
    assert [s["step"] for s in train_steps] == [1, 2], steps
    assert all(s["rollout/num_trajectories"] == 12 for s in train_steps)  # 3 prompts x n=4
    assert "reward_fn: reward_fn.math_reward_fn" in (tmp_path / "config.yaml").read_text()
    assert (tmp_path / "hf_model" / "config.json").exists()


def test_options_may_follow_the_subcommand_and_tools_list_sizes_the_tool_block(capsys, monkeypatch, tiny_model_path):
    """`tools list --json FILE` as users type it; with a run config each tool's prompt tokens (the tiny model's
    chat template) and a warning when the tool block pushes the longest prompt past data.max_prompt_length."""
    from transformers import AutoTokenizer

    monkeypatch.chdir(ROOT)
    assert main(["tools", "list", "--json", "examples/calculator/tools.yaml"]) == 0
    assert [s["function"]["name"] for s in json.loads(capsys.readouterr().out)] == ["calculator"]
    tok = AutoTokenizer.from_pretrained(str(tiny_model_path))
    schema = load_tools("examples/calculator/tools.yaml")["calculator"].get_openai_tool_schema().to_openai()
    def n_tokens(tools):
        text = tok.apply_chat_template([{"role": "user", "content": "x"}], tools=tools, add_generation_prompt=True,
                                       tokenize=False)
        return len(tok.encode(text, add_special_tokens=False))

    block = n_tokens([schema]) - n_tokens(None)
    assert main(["tools", "list", "examples/calculator/config.yaml"]) == 0
    out, err = capsys.readouterr()
    assert f"calculator  [verl_agent.tools.calculator.CalculatorTool, {block} prompt tokens]" in out
    assert f"tool block: {block} prompt tokens" in out and "data.max_prompt_length=256" in out and not err
    longest = int(out.split("longest prompt with it: ")[1].split(" tokens")[0])
    assert main(["tools", "list", "examples/calculator/config.yaml", f"data.max_prompt_length={longest - 1}"]) == 0
    err = capsys.readouterr().err
    assert f"of 1088 prompts exceed data.max_prompt_length={longest - 1} (longest: {longest} tokens" in err
    assert f"Raise data.max_prompt_length to {longest}" in err


def test_a_repeated_option_before_overrides_is_parsed_once():
    """Overrides after options take the re-parse path: an option given twice (--model) must not double."""
    from verl_agent.cli import parse_args

    args = parse_args(["eval", "c.yaml", "--model", "a", "--model", "b", "--k", "2", "data.train_batch_size=4"])
    assert (args.config, args.model, args.k, args.overrides) == ("c.yaml", ["a", "b"], 2, ["data.train_batch_size=4"])
    args = parse_args(["tools", "list", "--json", "t.yaml", "a=1"])
    assert (args.action, args.config, args.json, args.overrides) == ("list", "t.yaml", True, ["a=1"])
