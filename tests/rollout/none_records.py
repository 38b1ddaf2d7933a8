"""The records the `none` context strategy must reproduce: a seeded tiny-model rollout (calculator tool, a
response budget some trajectories reach), one trajectory at a time on a one-slot engine so that no float
depends on which requests happened to share a batch. `python tests/rollout/none_records.py OUT.json` writes them; the
fixture tests/fixtures/none_strategy_records.json was written by the code before context strategies existed."""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import asdict
from typing import Any


async def records(overrides: list[str]) -> list[dict[str, Any]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_agent.config import load_config
    from verl_agent.data import row_to_sample
    from verl_agent.engine.contract import SamplingParams
    from verl_agent.engine.backends.hf_engine import HFEngine
    from verl_agent.models.calculator_task import make_problems, make_verl_rows
    from verl_agent.models.tiny import build_tiny
    from verl_agent.reward import load_reward_fn
    from verl_agent.rollout.agent_loop import AgentLoop
    from verl_agent.tools import CalculatorTool

    path = str(build_tiny())
    model, tok = AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    rollout = load_config(None, overrides).actor_rollout_ref.rollout
    engine = HFEngine(model, max_num_seqs=1)  # one sequence at a time: no batch whose make-up depends on timing
    loop = AgentLoop(engine, tok, rollout, tools={"calculator": CalculatorTool()},
                     reward_fn=load_reward_fn("verl_agent.models.calculator_task.calculator_reward"),
                     max_prompt_length=256, max_response_length=40)  # fmt: skip
    rows = make_verl_rows(make_problems(4, seed=11, split="test"), "test")
    samples = [row_to_sample(r, f"test:{i}") for i, r in enumerate(rows)]
    trajs = []
    for i, s in enumerate(samples):  # one trajectory at a time, each with its own seed
        for k in range(2):
            sp = SamplingParams(temperature=1.0, max_new_tokens=72, seed=3 + 2 * i + k)
            trajs += (await loop.run([s], n=1, sampling=sp)).trajectories
    await engine.close()
    out = []
    for t in trajs:
        turns = [{k: v for k, v in asdict(x).items() if not k.endswith("_seconds")} for x in t.turns]
        out.append({"uid": t.uid, "prompt_ids": t.prompt_ids, "response_ids": t.response_ids, "loss_mask": t.loss_mask,
                    "rollout_logprobs": t.rollout_logprobs, "turns": turns, "stop_reason": t.stop_reason,
                    "reward": t.reward, "outcome": t.outcome, "cause": t.cause,
                    "messages": [m.to_chat() for m in t.messages],
                    "metrics": {k: v for k, v in t.metrics.items() if k != "seconds"}})
    return out


if __name__ == "__main__":
    recs = asyncio.run(records(sys.argv[2:]))
    with open(sys.argv[1], "w") as f:
        json.dump(recs, f, separators=(",", ":"))
