"""The tiny model trains one GRPO step with a non-default tool-call format: Qwen3-Coder's XML calls.

The tiny model's folder is copied with its chat template rewritten for that format
(tests/fixtures/templates/qwen3_coder.jinja, written to Qwen3-Coder's template on the Hugging Face hub) and
`multi_turn.format=qwen3_coder` is set. The tiny model was trained on hermes JSON calls, so a scripted engine
writes the turns (a call, then a thought and an answer); everything after it is the trainer's own: the agent loop
built from the config (parser, calculator tool, reward), `prepare.train_seqs`, and `Policy` (FSDP2 on one gloo
rank) for the log-prob pass, GRPO advantages and the update -- what each `TrainWorker` runs, in this process.
"""

from __future__ import annotations

import asyncio
import math
import shutil
from pathlib import Path

import pytest
import torch

from verl_agent.engine.contract import SamplingParams
from verl_agent.engine.backends.scripted import ScriptedEngine
from verl_agent.models.calculator_task import make_problems
from verl_agent.protocol import ToolCall
from verl_agent.rollout.build import build_agent_loop, build_reward, load_split, load_tokenizer, sampling_params

TEMPLATE = Path(__file__).parents[1] / "fixtures" / "templates" / "qwen3_coder.jinja"


@pytest.fixture
def coder_model(tiny_model_path: Path, tmp_path: Path) -> Path:
    """The tiny model with Qwen3-Coder's chat template in place of its hermes one."""
    out = tmp_path / "tiny_qwen3_coder"
    shutil.copytree(tiny_model_path, out)
    (out / "chat_template.jinja").write_text(TEMPLATE.read_text())
    return out


def _script(tok, expression: str):
    """Turn 1 calls the calculator in Qwen3-Coder's XML; turn 2 thinks, then answers: the first answer of the
    episode pair is the tool's result (reward 1), the second is off by one (reward 0), so GRPO has a signal."""
    answers = iter((0, 1))

    def reply(ids: list[int], _sp: SamplingParams) -> str:
        text = tok.decode(ids)
        if "<tool_response>" not in text:
            return ("Let me compute it.\n\n<tool_call>\n<function=calculator>\n<parameter=expression>\n"
                    f"{expression}\n</parameter>\n</function>\n</tool_call>")  # fmt: skip
        result = int(text.rsplit("<tool_response>\n", 1)[1].split("\n</tool_response>", 1)[0])
        return f"<think>\nThe calculator says {result}.\n</think>\n\nThe answer is {result + next(answers)}."

    return reply


def test_one_grpo_step_with_qwen3_coder_tool_calls(make_cfg, coder_model, one_rank):
    from verl_agent.trainer.policy.policy import Policy
    from verl_agent.trainer.policy.prepare import train_seqs

    cfg = make_cfg(f"actor_rollout_ref.model.path={coder_model}",
                   "actor_rollout_ref.rollout.multi_turn.format=qwen3_coder", "actor_rollout_ref.rollout.n=2",
                   "data.train_batch_size=1", "actor_rollout_ref.actor.ppo_mini_batch_size=1",
                   "trainer.num_cpu_workers=1", "data.max_response_length=128")  # fmt: skip
    arr = cfg.actor_rollout_ref
    assert cfg.algorithm.adv_estimator == "grpo"
    tok = load_tokenizer(arr.model)
    assert "<function=" in tok.chat_template  # the rewritten template is the one the run reads
    sample = load_split(cfg.data, "train")[0]
    problem = make_problems(1, seed=0, split="train")[0]  # the first row of calc_data, with its expression
    assert sample.messages[-1].content == problem["prompt"]
    expression = problem["expression"]
    engine = ScriptedEngine(tok, _script(tok, expression), eos_id=tok.convert_tokens_to_ids("<|im_end|>"))
    loop = build_agent_loop(arr.rollout, cfg.data, engine, tok, build_reward(cfg.data, cfg.custom_reward_function,
                                                                             cfg.reward_model))  # fmt: skip
    trajs = asyncio.run(loop.run([sample], arr.rollout.n, sampling_params(arr.rollout, cfg.data, 0))).trajectories

    assert engine.calls == 4 and sorted(t.reward for t in trajs) == [0.0, 1.0]
    for t in trajs:
        assert t.error is None and t.cause in (None, "wrong_answer")  # no call counted as malformed
        call, tool, answer = (m for m in t.messages if m.role != "system" and m.role != "user")
        assert call.tool_calls == [ToolCall("calculator", {"expression": expression}, id=call.tool_calls[0].id)]
        assert call.content == "Let me compute it."  # the text before the call, the XML parsed away
        assert tool.role == "tool" and tool.content == sample.ground_truth  # the calculator ran
        assert answer.reasoning_content == f"The calculator says {sample.ground_truth}."
        assert "<think>" not in answer.content and answer.content.startswith("The answer is")
        assert [x.num_tool_calls for x in t.turns] == [1, 0]
        last = t.turns[1]  # the reasoning is model output: its tokens stay in the response, trained
        assert "<think>" in tok.decode(t.response_ids[last.gen_start : last.gen_end])
        assert set(t.loss_mask[last.gen_start : last.gen_end]) == {1}
        t.check()

    seqs, counts = train_seqs(trajs, group_estimator=True)
    assert counts["train/sequences"] == 2.0
    policy = Policy(cfg, 0, torch.device("cpu"), one_rank, str(coder_model))
    before = {n: p.detach().clone() for n, p in policy.actor.named_parameters()}
    policy.compute_log_probs(seqs, n_minibatches=1)
    seqs, _ = policy.compute_advantages(seqs, kl_coef=0.0)
    by_reward = {s.score: s for s in seqs}
    for score, sign in ((1.0, 1), (0.0, -1)):  # GRPO: the right answer above its group's mean, the wrong below
        s = by_reward[score]
        trained = s.advantages[s.loss_mask.bool()]
        assert trained.numel() > 0 and bool((torch.sign(trained) == sign).all())
    metrics = policy.update(seqs, n_minibatches=1, step=1)
    assert math.isfinite(metrics["pg_loss"]) and math.isfinite(metrics["grad_norm"]) and metrics["grad_norm"] > 0
    assert any(not torch.equal(p.detach(), before[n]) for n, p in policy.actor.named_parameters())
