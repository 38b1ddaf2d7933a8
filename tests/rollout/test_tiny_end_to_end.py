"""Real generation end to end on CPU: the tiny model, HFEngine, the calculator tool, the reward, the CLI path."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from verl_agent.config import RolloutConfig, load_config
from verl_agent.data import row_to_sample
from verl_agent.models.calculator_task import make_problems, make_verl_rows
from verl_agent.reward import load_reward_fn
from verl_agent.rollout.agent_loop import AgentLoop
from verl_agent.engine.contract import SamplingParams
from verl_agent.rollout.evaluation.evaluate import evaluate_cli
from verl_agent.engine.backends.hf_engine import HFEngine
from verl_agent.rollout.metrics import summarize
from verl_agent.rollout.records import print_records, read_records
from verl_agent.tools import CalculatorTool

REWARD = "verl_agent.models.calculator_task.calculator_reward"


@pytest.fixture(scope="module")
def tiny(tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_path)).eval()
    return model, AutoTokenizer.from_pretrained(str(tiny_model_path))


def _samples(n: int):
    rows = make_verl_rows(make_problems(n, seed=5, split="test"), "test")
    return [row_to_sample(r, f"test:{i}") for i, r in enumerate(rows)]


async def test_tiny_model_multi_turn_rollout(tiny):
    model, tok = tiny
    engine = HFEngine(model, max_num_seqs=16)
    loop = AgentLoop(engine, tok, RolloutConfig(), tools={"calculator": CalculatorTool()},
                     reward_fn=load_reward_fn(REWARD), max_prompt_length=256, max_response_length=160)  # fmt: skip
    batch = await loop.run(_samples(6), n=2, sampling=SamplingParams(temperature=1.0, max_new_tokens=64, seed=0))
    assert len(batch) == 12 and len(batch.groups()) == 6
    eos = set(tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]))
    for traj in batch.trajectories:
        assert traj.error is None, traj.error
        traj.check()
        for t in traj.turns:  # each turn that was followed by an observation ended on an end-of-turn token
            if t.obs_end > t.gen_end:
                assert traj.response_ids[t.gen_end - 1] in eos
        ids = torch.tensor([traj.prompt_ids + traj.response_ids])
        with torch.no_grad():
            logits = model(ids).logits[0, len(traj.prompt_ids) - 1 : -1]
        ref = logits.log_softmax(-1).gather(-1, ids[0, len(traj.prompt_ids) :, None]).squeeze(-1)
        mask = torch.tensor(traj.loss_mask, dtype=torch.bool)
        got = torch.tensor(traj.rollout_logprobs)
        torch.testing.assert_close(got[mask], ref[mask], atol=2e-3, rtol=0)  # rollout == trainer log-probs
        assert (got[~mask] == 0).all()
    m = summarize(batch)
    assert m["rollout/num_trajectories"] == 12 and 0 <= m["rollout/success_rate"] <= 1
    assert m["rollout/tool_calls_total"] > 0  # the tiny model was trained to call the calculator
    await engine.close()


def test_rollout_cli(tiny_model_path, tmp_path, capsys):
    data = tmp_path / "val.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in make_verl_rows(make_problems(4, seed=3, split="test"), "test")))
    tools = tmp_path / "tools.yaml"
    tools.write_text("tools:\n  - class_name: verl_agent.tools.calculator.CalculatorTool\n    config: {}\n")
    cfg = load_config(None, [
        f"actor_rollout_ref.model.path={tiny_model_path}", f"data.val_files=[{data}]", f"data.reward_fn={REWARD}",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tools}", "actor_rollout_ref.rollout.val_kwargs.n=2",
        "data.max_response_length=96", "trainer.device=cpu",
    ])  # fmt: skip
    out = tmp_path / "traj.jsonl"
    assert evaluate_cli(cfg, split="val", out=str(out)) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["rollout/num_trajectories"] == 8 and "rollout/success_rate" in last
    recs = list(read_records(out))
    assert len(recs) == 8 and recs[0]["messages"][0]["role"] == "system"
    assert len(recs[0]["loss_mask"]) == len(recs[0]["response_ids"])
    assert print_records(out, limit=3) == 3
