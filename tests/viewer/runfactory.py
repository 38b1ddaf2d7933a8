"""Builders of a small but real run directory for the viewer tests, written the way the trainer writes one.

Trajectories are synthetic `Trajectory` objects whose token ids come from the embedded tiny
model's tokenizer (so per-token decoding is real), written with `records.write_records`; the run's
config.yaml names `model.path: tiny` like the examples do. Nothing is trained.
"""

from __future__ import annotations

import json
from pathlib import Path

from verl_agent.protocol import Message, RolloutBatch, ToolCall, Trajectory, Turn

METRIC_STEPS = [1, 2, 3]


class _Builder:
    """Builds a Trajectory turn by turn: model tokens (mask 1) then observation tokens (mask 0)."""

    def __init__(self, tok, uid: str, prompt: str):
        self.tok, self.uid = tok, uid
        self.prompt_ids = tok.encode(f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n").ids
        self.ids: list[int] = []
        self.mask: list[int] = []
        self.lps: list[float] = []
        self.turns: list[Turn] = []
        self.messages = [Message("user", prompt)]

    def turn(self, text: str, obs: str = "", score: float = 0.0, calls: list[ToolCall] | None = None,
             reasoning: str | None = None) -> _Builder:  # fmt: skip
        start = len(self.ids)
        think = f"<think>\n{reasoning}\n</think>\n\n" if reasoning else ""  # generated, so trained (mask 1)
        gen = self.tok.encode(think + text + "<|im_end|>").ids
        self.ids += gen
        self.mask += [1] * len(gen)
        self.lps += [round(-0.05 * (k % 7), 5) for k in range(len(gen))]
        end = len(self.ids)
        obs_ids = self.tok.encode(obs).ids if obs else []
        self.ids += obs_ids
        self.mask += [0] * len(obs_ids)
        self.lps += [0.0] * len(obs_ids)
        self.turns.append(Turn(start, end, len(self.ids), num_tool_calls=len(calls or []), score=score,
                               gen_seconds=0.25, tool_seconds=0.01 if calls else 0.0))  # fmt: skip
        self.messages.append(Message("assistant", text if not calls else "", tool_calls=calls or [],
                                     reasoning_content=reasoning))  # fmt: skip
        return self

    def tool_result(self, name: str, call_id: str, content: str) -> _Builder:
        self.messages.append(Message("tool", content, tool_call_id=call_id, name=name))
        return self

    def build(self, reward: float, outcome: str = "ok", cause: str | None = None, stop: str = "end_of_turn",
              error: str | None = None, version: int = 0) -> Trajectory:  # fmt: skip
        t = Trajectory(self.uid, self.prompt_ids, self.ids, self.mask, self.lps, reward=reward, turns=self.turns,
                       stop_reason=stop, messages=self.messages, outcome=outcome, cause=cause, error=error,
                       policy_version=version, metrics={"num_turns": float(len(self.turns))})  # fmt: skip
        t.check()
        return t


def step_batch(tok, step: int) -> RolloutBatch:
    """4 trajectories: a tool-using success, a wrong answer, an infra failure, a truncated one."""
    call = ToolCall("calculator", {"expression": "37 * 12"}, id=f"call_{step}")
    ok = (_Builder(tok, "calc:1", "What is 37 * 12?")
          .turn("", obs="<|im_start|>tool\n444<|im_end|>\n<|im_start|>assistant\n", calls=[call], score=0.1)
          .tool_result("calculator", call.id, "444")
          .turn("The answer is 444.", score=1.0)
          .build(1.0, version=step - 1))  # fmt: skip
    wrong = _Builder(tok, "calc:1", "What is 37 * 12?").turn(f"The answer is {400 + step}.").build(
        0.0, "policy_failure", "wrong_answer", version=step - 1)
    infra = _Builder(tok, "calc:2", "Compute 2 ** 10.").turn("", calls=[ToolCall("python", {"code": "2**10"})]).build(
        0.0, "infra_failure", "tool_timeout", stop="error", error="TimeoutError: sandbox did not answer in 30 s")
    trunc = _Builder(tok, "calc:2", "Compute 2 ** 10.").turn("Let me think step by step about powers").build(
        0.0, "policy_failure", "budget_exhausted", stop="response_budget")
    return RolloutBatch([ok, wrong, infra, trunc])


def reasoning_batch(tok) -> RolloutBatch:
    """1 trajectory of a reasoning model: a thought before a tool call, another before the answer."""
    call = ToolCall("calculator", {"expression": "37 * 12"}, id="call_r")
    t = (_Builder(tok, "think:1", "What is 37 * 12?")
         .turn("", obs="<|im_start|>tool\n444<|im_end|>\n<|im_start|>assistant\n", calls=[call], score=0.1,
               reasoning="Multiplication: better ask the calculator.")
         .tool_result("calculator", call.id, "444")
         .turn("The answer is 444.", score=1.0, reasoning="The calculator said 444; that is the product.")
         .build(1.0))  # fmt: skip
    return RolloutBatch([t])


def write_metrics(run: Path) -> None:
    rows = []
    for s in METRIC_STEPS:
        row = {"step": s, "rollout/reward/mean": 0.2 * s, "rollout/success_rate": 0.25 * s,
               "rollout/response_length/mean": 10.0 + s, "actor/entropy": 1.5 - 0.1 * s, "actor/kl": 0.01 * s,
               "time/rollout": 2.0, "time/update": 1.0 + s, "rollout/infra_failed": 1.0,
               "rollout/infra_failed/tool_timeout": 1.0}  # fmt: skip
        if s in (1, 3):
            row["val/success_rate"] = 0.3 * s
        rows.append(json.dumps(row))
    (run / "metrics.jsonl").write_text("\n".join(rows) + "\n")


def add_advantages(path: Path, per_record: dict[int, float]) -> None:
    """Give records of a written step file the trainer's per-token "advantages" field (0.0 off the loss mask):
    record i gets per_record[i] on its first turn's tokens and twice that on later turns (a diverging range)."""
    lines = path.read_text().splitlines()
    for i, adv in per_record.items():
        rec = json.loads(lines[i])
        first_end = rec["turns"][0]["gen_end"]
        rec["advantages"] = [0.0 if not m else round(adv if k < first_end else 2 * adv, 4)
                             for k, m in enumerate(rec["loss_mask"])]  # fmt: skip
        lines[i] = json.dumps(rec)
    path.write_text("\n".join(lines) + "\n")
