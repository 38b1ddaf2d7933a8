"""A tool-use warm start for SmolLM2-135M-Instruct on the terminal tasks: SFT on the oracle's solutions as chats.

    python examples/terminal_tasks/warm_start.py --chats   # rewrites data/warm_start.jsonl (needs Docker)
    python examples/terminal_tasks/warm_start.py           # prints the model folder (built once, then cached)
    verl-agent train examples/terminal_tasks/config.yaml \\
        actor_rollout_ref.model.path=$(python examples/terminal_tasks/warm_start.py)

The chats: each training task's oracle, as tool calls (``manifest.json``: one ``bash`` call for most
families; ``cat`` then a ``str_replace_editor`` edit for ``fixbug``), then ``submit``. ``--chats`` replays
those calls through the real container tools of ``tools.yaml`` in the task's own container, so every
observation in the data is what the agent loop will show, and it fails unless the task's tests then
give reward 1. The file is committed: building the model needs no Docker.

The SFT uses the recipe of ``examples/smollm2_calculator/warm_start.py`` (``verl_agent.models.sft_data``
and ``sft_train``): ids and loss mask built exactly as the agent loop builds them (tool results are
observations, never trained on), the tool list of ``config.yaml`` rendered by SmolLM2's template, no
system prompt of our own (the RL samples have none). It trains on ``task_fraction`` of the training
tasks (the first ones of each family), so RL still has tasks whose solution it never saw, and every
held-out task is unseen. ``warm_start.json`` in the folder records the loss and how often the model's
first turn on the held-out instructions is a well-formed call of a known tool (sampled, temperature 1).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hashlib
import json
import logging
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SUITE = HERE / "tasks"
CHATS = HERE / "data" / "warm_start.jsonl"


@dataclasses.dataclass(frozen=True)
class WarmStart:
    recipe_version: int = 1
    task_fraction: float = 0.5  # of each family's training tasks, demonstrated in the SFT
    steps: int = 40
    batch_size: int = 8
    lr: float = 5e-5
    warmup_steps: int = 4
    n_eval: int = 21  # held-out instructions whose first turn is checked
    seed: int = 0

    def key(self, base: str) -> str:
        blob = json.dumps({**dataclasses.asdict(self), "base": base, "tools": tool_schemas(),
                           "chats": hashlib.sha256(CHATS.read_bytes()).hexdigest()}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def manifest() -> dict[str, Any]:
    return json.loads((SUITE / "manifest.json").read_text())


def tool_schemas() -> list[dict]:
    """The tool list the RL run renders (config.yaml's tool_config_path), so SFT chats render the same."""
    from verl_agent.config import load_config
    from verl_agent.tools.registry import load_tools

    path = load_config(str(HERE / "config.yaml")).actor_rollout_ref.rollout.multi_turn.tool_config_path
    return [t.get_openai_tool_schema().to_openai() for t in load_tools(REPO / path).values()]


# ---------------------------------------------------------------- the chats (real tools, real containers)
def _call(name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
                                                                "function": {"name": name, "arguments": arguments}}]}


async def _replay(tools: dict[str, Any], entry: dict[str, Any]) -> dict[str, Any]:
    """One task's oracle calls in its container; the chat, and the reward its tests give afterwards."""
    iid, task_dir = f"warm-start-{entry['name']}", str(SUITE / entry["path"])
    for tool in tools.values():
        await tool.create(iid, task_dir=task_dir)
    try:
        messages = [{"role": "user", "content": entry["instruction"]}]
        for call in entry["tool_calls"]:
            response, _, _ = await tools[call["name"]].execute(iid, call["arguments"])
            messages += [_call(call["name"], call["arguments"]),
                         {"role": "tool", "name": call["name"], "content": response.text}]
        await tools["submit"].execute(iid, {})
        messages.append(_call("submit", {}))
        reward = await tools["submit"].calc_reward(iid)
    finally:
        for tool in tools.values():
            await tool.release(iid)
    return {"task": f"../tasks/{entry['path']}", "family": entry["family"], "reward": reward, "messages": messages}


async def make_chats(out: Path = CHATS, jobs: int = 4) -> list[dict[str, Any]]:
    """Replay every training task's oracle through tools.yaml's tools; write the chats as JSONL."""
    from verl_agent.tasks import env
    from verl_agent.tools.registry import load_tools

    tools = load_tools(HERE / "tools.yaml")
    limit = asyncio.Semaphore(jobs)

    async def one(entry: dict[str, Any]) -> dict[str, Any]:
        async with limit:
            return await _replay(tools, entry)

    try:
        rows = await asyncio.gather(*(one(e) for e in manifest()["tasks"] if e["split"] == "train"))
    finally:
        env.close_pool()
    failed = [r["task"] for r in rows if r["reward"] != 1.0]
    if failed:
        raise RuntimeError(f"the oracle's calls did not solve {failed}: fix the generator before training on them")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def chosen_chats(w: WarmStart) -> list[dict[str, Any]]:
    """The first `task_fraction` of each family's training chats (at least one per family)."""
    rows = [json.loads(line) for line in CHATS.read_text().splitlines()]
    by_family: dict[str, list[dict]] = {}
    for r in rows:
        by_family.setdefault(r["family"], []).append(r)
    return [r for fam in by_family.values() for r in fam[: max(1, round(w.task_fraction * len(fam)))]]


# ---------------------------------------------------------------- the SFT
def first_turn_call_rate(model: Any, tok: Any, tools: list[dict], instructions: list[str], seed: int) -> float:
    """How often the sampled first turn (T=1) is a well-formed call of a listed tool with its required keys."""
    import torch

    from verl_agent.chat import ChatEncoder
    from verl_agent.parsers import get_parser
    from verl_agent.protocol import Message

    enc, parser = ChatEncoder(tok, tools=tools), get_parser("hermes")
    required = {t["function"]["name"]: set(t["function"]["parameters"].get("required", [])) for t in tools}
    torch.manual_seed(seed)
    model.eval()
    good = 0
    for text in instructions:
        ids = torch.tensor([enc.encode_prompt([Message("user", text)])], device=model.device)
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=96, do_sample=True, temperature=1.0, top_k=0,
                                 eos_token_id=enc.eos_token_ids, pad_token_id=tok.pad_token_id)
        parsed = parser.parse(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=False))
        good += any(c.name in required and required[c.name] <= set(c.arguments) for c in parsed.tool_calls)
    return good / max(1, len(instructions))


def warm_start(w: WarmStart | None = None, cache: Path | None = None) -> Path:
    """The warm-started model folder (built on first use; concurrent callers wait for one build)."""
    import torch

    from verl_agent.models.smollm2 import build_smollm2
    from verl_agent.models.warm_start import warm_start as cached_sft
    from verl_agent.protocol import Message

    w = w or WarmStart()
    base = str(build_smollm2())
    heldout = [e["instruction"] for e in manifest()["tasks"] if e["split"] == "heldout"][: w.n_eval]
    before: list[float] = []

    def rows(tok: Any, model: Any) -> list:  # the held-out call rate of the base model is measured here, first
        from verl_agent.chat import ChatEncoder
        from verl_agent.models.sft_data import encode_conversation

        before.append(first_turn_call_rate(model, tok, tool_schemas(), heldout, w.seed))
        enc = ChatEncoder(tok, tools=tool_schemas())
        return [encode_conversation(enc, [Message.from_chat(m) for m in c["messages"]]) for c in chosen_chats(w)]

    def figures(model: Any, tok: Any) -> dict[str, Any]:
        after = first_turn_call_rate(model, tok, tool_schemas(), heldout, w.seed)
        return {"n_chats": len(chosen_chats(w)), "n_eval": len(heldout),
                "heldout_first_turn_call_rate": {"before": before[0], "after": after}}

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return cached_sft("smollm2-terminal", w, base, w.key(base), rows, evaluate=figures, device=device, last=10,
                      cache=cache)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chats", action="store_true", help="rewrite data/warm_start.jsonl by replaying the oracle")
    if parser.parse_args().chats:
        n = len(asyncio.run(make_chats()))
        print(f"{n} chats, every one graded 1, in {CHATS}")
    else:
        print(warm_start())
