"""multi_turn.history and reasoning in the native agent loop, on a Qwen3-style template that drops the <think>
blocks of turns before the last user message (tests/fixtures/templates/qwen3_think.jinja).

exact appends token-exact observations (impossible here once a user reply makes the template drop old
reasoning); template gives every turn the context the template renders, as at deployment, and trains
a turn whose context the template rewrote as its own segment. Reasoning tokens are model tokens: mask 1.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from model_helpers import sample, scripted_engine

from verl_agent.chat import ChatEncoder
from verl_agent.interactions.base import BaseInteraction
from verl_agent.rollout.agent_loop import AgentLoop
from verl_agent.engine.contract import SamplingParams

QWEN3 = (Path(__file__).parents[1] / "fixtures" / "templates" / "qwen3_think.jinja").read_text()
REPLIES = ["<think>\nguess low\n</think>\n\nIt is 400.", "<think>\nfix it\n</think>\n\nIt is 444."]


class Guess(BaseInteraction):
    async def generate_response(self, instance_id, messages, **kwargs):
        done = "444" in messages[-1]["content"]
        self.instances[instance_id]["score"] = float(done)
        return done, "Correct!" if done else "Wrong, try again.", float(done), {}


@pytest.fixture
def qwen3_tok(chat_tokenizer):
    tok = copy.deepcopy(chat_tokenizer)
    tok.chat_template = QWEN3
    return tok


async def _run(tok, cfg, history: str):
    cfg.multi_turn.history = history
    loop = AgentLoop(scripted_engine(tok, REPLIES), tok, cfg, interactions={"guess": Guess({"name": "guess"})},
                     max_prompt_length=400, max_response_length=400)  # fmt: skip
    s = sample(interaction_kwargs={"name": "guess"})
    return (await loop.run([s], 1, SamplingParams(max_new_tokens=100))).trajectories


async def test_template_history_trains_each_rewritten_turn_as_a_segment(qwen3_tok, rollout_cfg) -> None:
    segs = await _run(qwen3_tok, rollout_cfg, "template")
    assert len(segs) == 2 and [t.outcome for t in segs] == ["ok", "ok"]
    assert [t.stop_reason for t in segs] == ["context_rewrite", "interaction_done"]
    enc = ChatEncoder(qwen3_tok)
    transcript = segs[-1].messages
    assert [m.reasoning_content for m in transcript if m.role == "assistant"] == ["guess low", "fix it"]
    assert [m.content for m in transcript if m.role == "assistant"] == ["It is 400.", "It is 444."]
    # the second turn saw what the template renders at deployment: the first turn's reasoning dropped
    assert segs[1].prompt_ids == enc.encode_prompt(transcript[:3])
    assert "guess low" not in qwen3_tok.decode(segs[1].prompt_ids) and "It is 400." in qwen3_tok.decode(segs[1].prompt_ids)
    for seg, reply in zip(segs, REPLIES):
        generated = [i for i, m in zip(seg.response_ids, seg.loss_mask) if m]
        assert qwen3_tok.decode(generated, skip_special_tokens=True) == reply  # reasoning tokens are trained
        assert sum(seg.loss_mask) == len(generated) == seg.turns[0].gen_end - seg.turns[0].gen_start


async def test_template_history_keeps_one_segment_while_the_template_only_appends(qwen3_tok, rollout_cfg) -> None:
    """Without a user reply in between (tool turns keep their reasoning in Qwen3's template) nothing is rewritten:
    template and exact give the same single trajectory."""
    from model_helpers import call_text

    from verl_agent.tools import CalculatorTool

    replies = ["<think>\nuse the tool\n</think>\n\n" + call_text("calculator", '{"expression": "12*37"}'),
               "<think>\ndone\n</think>\n\nThe answer is 444."]  # fmt: skip
    out = {}
    for history in ("exact", "template"):
        rollout_cfg.multi_turn.history = history
        loop = AgentLoop(scripted_engine(qwen3_tok, replies), qwen3_tok, rollout_cfg,
                         tools={"calculator": CalculatorTool()}, max_prompt_length=400, max_response_length=400)
        out[history] = (await loop.run([sample()], 1, SamplingParams(max_new_tokens=100))).trajectories
    assert len(out["template"]) == len(out["exact"]) == 1
    a, b = out["exact"][0], out["template"][0]
    assert (a.prompt_ids, a.response_ids, a.loss_mask) == (b.prompt_ids, b.response_ids, b.loss_mask)
    assert b.messages[1].reasoning_content == "use the tool" and b.messages[1].tool_calls[0].name == "calculator"


async def test_exact_history_fails_loudly_when_the_template_drops_reasoning(qwen3_tok, rollout_cfg) -> None:
    segs = await _run(qwen3_tok, rollout_cfg, "exact")
    assert segs[0].outcome == "infra_failure" and "not prefix-stable" in segs[0].error
