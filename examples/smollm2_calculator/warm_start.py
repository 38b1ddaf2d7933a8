"""A tool-call warm start for SmolLM2-135M-Instruct: a short SFT on calculator chats before GRPO.

    python examples/smollm2_calculator/warm_start.py      # prints the model folder (built once, then cached)
    verl-agent train examples/smollm2_calculator/config.yaml \
        actor_rollout_ref.model.path=$(python examples/smollm2_calculator/warm_start.py)

Under GRPO alone SmolLM2 never wrote a tool call (0 of 256 held-out problems before and after 40 steps,
README.md), so RL had no calls to reinforce. This SFT uses the tiny model's recipe (verl_agent/models/
sft_data.py) with this example's system prompt and tool list: most chats call the calculator and copy its
result, but the call-or-answer decision is trained on a balanced subset so that the model calls the tool
in about `tool_call_prior` of the problems. RL then has a clear signal: calling raises the reward. Direct
answers are trained on noisy "mental math", so copying stays the only reliable way to be right.

Runs on the GPU when there is one, else on the CPU (about 7 minutes on 2 cores; tests use a few steps). The folder is
keyed by a hash of the recipe under ~/.cache/verl_agent; `warm_start.json` records the held-out tool-call
and success rates of the result (sampled, temperature 1, the same system prompt as the RL data).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import random
import runpy
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


@dataclasses.dataclass(frozen=True)
class WarmStart:
    recipe_version: int = 1
    n_problems: int = 1000
    tool_fraction: float = 0.8  # chats that call the calculator (copying practice)
    tool_call_prior: float = 0.3  # how often the warm-started model should choose to call it
    steps: int = 40
    batch_size: int = 8
    lr: float = 5e-5
    warmup_steps: int = 4
    n_eval: int = 64
    seed: int = 0

    def key(self, base: str) -> str:
        prompt = {"system": system_prompt(), "tools": tool_schemas()}
        blob = json.dumps({**dataclasses.asdict(self), "base": base, **prompt}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def system_prompt() -> str:
    """The system prompt of this example's RL data (make_data.py), which the SFT chats use too."""
    return runpy.run_path(str(HERE / "make_data.py"))["SYSTEM_PROMPT"]


def tool_schemas() -> list[dict]:
    """The tool list the RL run renders (config.yaml's tool_config_path), so SFT chats render the same."""
    from verl_agent.config import load_config
    from verl_agent.tools.registry import load_tools

    path = load_config(str(HERE / "config.yaml")).actor_rollout_ref.rollout.multi_turn.tool_config_path
    return [t.get_openai_tool_schema().to_openai() for t in load_tools(REPO / path).values()]


def encode(w: WarmStart) -> Callable[[Any, Any], list]:
    """The SFT rows: calculator problems solved with the tool or directly, the decision trained at the rates
    that make the model call the tool about `tool_call_prior` of the time (`sft_data.decision_rates`)."""
    def rows(tok: Any, model: Any) -> list:
        from verl_agent.chat import ChatEncoder
        from verl_agent.models.calculator_task import make_problems
        from verl_agent.models.sft_data import conversation, decision_rates, encode_conversation
        from verl_agent.protocol import Message

        system = Message("system", system_prompt())
        rng, enc = random.Random(w.seed), ChatEncoder(tok, tools=tool_schemas())
        p_tool, p_direct = decision_rates(w.tool_fraction, w.tool_call_prior)
        data = []
        for problem in make_problems(w.n_problems, seed=w.seed, split="train"):
            use_tool = rng.random() < w.tool_fraction
            chat = [m for m in conversation(problem, use_tool, rng) if m.role != "system"]
            train_decision = rng.random() < (p_tool if use_tool else p_direct)
            data.append(encode_conversation(enc, [system, *chat], train_decision))
        return data
    return rows


def evaluate(w: WarmStart) -> Callable[[Any, Any], dict[str, Any]]:
    """The trained model's held-out tool-call and success rates."""
    def figures(model: Any, tok: Any) -> dict[str, Any]:
        from verl_agent.models.calculator_task import make_problems
        from verl_agent.models.evaluate import evaluate_rates

        rates = evaluate_rates(model, tok, make_problems(w.n_eval, seed=w.seed + 1, split="test"),
                               seed=w.seed, system_prompt=system_prompt(), tools=tool_schemas())
        return {"tool_call_rate": rates.tool_call_rate, "success_rate": rates.success_rate, "n_eval": rates.n}
    return figures


def warm_start(w: WarmStart | None = None, cache: Path | None = None) -> Path:
    """The warm-started model folder (built on first use; concurrent callers wait for one build)."""
    import torch

    from verl_agent.models.smollm2 import build_smollm2
    from verl_agent.models.warm_start import warm_start as cached_sft

    w = w or WarmStart()
    base = str(build_smollm2())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return cached_sft("smollm2-tools", w, base, w.key(base), encode(w), evaluate=evaluate(w), device=device,
                      cache=cache)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    print(warm_start())
