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
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
log = logging.getLogger(__name__)


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


def build(out: Path, base: str, w: WarmStart) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_agent.chat import ChatEncoder
    from verl_agent.models.calculator_task import make_problems
    from verl_agent.models.evaluate import evaluate_rates
    from verl_agent.models.sft_data import conversation, decision_rates, encode_conversation
    from verl_agent.models.sft_train import group_by_prefix, train
    from verl_agent.protocol import Message

    t0 = time.perf_counter()
    torch.manual_seed(w.seed)
    system = Message("system", system_prompt())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).to(device)
    tools = tool_schemas()
    rng, enc = random.Random(w.seed), ChatEncoder(tok, tools=tools)
    p_tool, p_direct = decision_rates(w.tool_fraction, w.tool_call_prior)
    data = []
    for problem in make_problems(w.n_problems, seed=w.seed, split="train"):
        use_tool = rng.random() < w.tool_fraction
        chat = [m for m in conversation(problem, use_tool, rng) if m.role != "system"]
        train_decision = rng.random() < (p_tool if use_tool else p_direct)
        data.append(encode_conversation(enc, [system, *chat], train_decision))
    losses = train(model, group_by_prefix(data, tok.convert_tokens_to_ids("<|im_end|>")), w, w.seed)
    rates = evaluate_rates(model, tok, make_problems(w.n_eval, seed=w.seed + 1, split="test"),
                           seed=w.seed, system_prompt=system.content, tools=tools)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    info = {"settings": dataclasses.asdict(w), "base": base, "device": device,
            "final_loss": round(sum(losses[-20:]) / len(losses[-20:]), 4), "tool_call_rate": rates.tool_call_rate,
            "success_rate": rates.success_rate, "n_eval": rates.n, "seconds": round(time.perf_counter() - t0, 1)}
    (out / "warm_start.json").write_text(json.dumps(info, indent=2))  # written last: marks the folder complete
    log.info("SmolLM2 warm start built in %.0f s: final loss %.3f, tool-call rate %.2f, success %.2f",
             info["seconds"], info["final_loss"], rates.tool_call_rate, rates.success_rate)


def warm_start(w: WarmStart | None = None, cache: Path | None = None) -> Path:
    """The warm-started model folder (built on first use; concurrent callers wait for one build)."""
    from verl_agent.models.smollm2 import build_smollm2
    from verl_agent.models.tiny import cache_root, cached_build

    w = w or WarmStart()
    base = str(build_smollm2())
    target = (cache or cache_root()) / f"smollm2-tools-{w.key(base)}"
    return cached_build(target, "warm_start.json", lambda tmp: build(tmp, base, w))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    print(warm_start())
