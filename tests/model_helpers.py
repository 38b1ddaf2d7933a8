"""Shared test helpers: scripted engines and the token-exactness check."""

from __future__ import annotations

import asyncio
from typing import Any

from verl_agent.chat import ChatEncoder
from verl_agent.protocol import Message, Sample, Trajectory
from verl_agent.engine.backends.scripted import ScriptedEngine
from verl_agent.tools import BaseTool, ToolResponse


def call_text(name: str, args: str) -> str:
    """The assistant text the tiny model's ChatML template renders for one tool call (after the generation prompt)."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>'


def scripted_engine(tok: Any, replies: list[str] | Any, **kw: Any) -> ScriptedEngine:
    """Reply replies[k] on the k-th assistant turn (the last one repeats); a callable gets (prompt_text, k)."""

    def script(ids: list[int], _sp: Any) -> str:
        text = tok.decode(ids)
        k = text.count("<|im_start|>assistant") - 1
        if callable(replies):
            return replies(text, k)
        return replies[min(k, len(replies) - 1)]

    return ScriptedEngine(tok, script, eos_id=tok.convert_tokens_to_ids("<|im_end|>"), **kw)


def sample(question: str = "What is 12 * 37?", uid: str = "s0", **kw: Any) -> Sample:
    return Sample(uid=uid, messages=[Message(role="user", content=question)], **kw)


def assert_token_exact(tok: Any, traj: Trajectory, tools: dict[str, BaseTool] | None) -> None:
    """prompt_ids + response_ids == the template's encoding of the whole conversation (up to the final newline)."""
    schemas = [t.get_openai_tool_schema().to_openai() for t in tools.values()] if tools else None
    enc = ChatEncoder(tok, tools=schemas)
    full = enc.encode_text(enc.render(traj.messages, add_generation_prompt=False))
    ids = traj.prompt_ids + traj.response_ids
    assert full[: len(ids)] == ids, (tok.decode(full), tok.decode(ids))
    assert tok.decode(full[len(ids) :]) in ("", "\n")


def assert_mask(traj: Trajectory, eos_id: int) -> None:
    """Mask 1 exactly on the turns' generated spans (each ending with eos), log-probs only there."""
    expect = [0] * len(traj.response_ids)
    for t in traj.turns:
        expect[t.gen_start : t.gen_end] = [1] * (t.gen_end - t.gen_start)
        assert traj.response_ids[t.gen_end - 1] == eos_id
    assert traj.loss_mask == expect
    for m, lp in zip(traj.loss_mask, traj.rollout_logprobs):
        assert (lp == -0.5) if m else (lp == 0.0)


class CountingTool(BaseTool):
    """Echoes its argument after `delay` s; counts create/release and the peak number of concurrent calls."""

    def __init__(self, name: str = "echo", delay: float = 0.0, fail: bool = False, text_len: int = 0) -> None:
        schema = {
            "type": "function",
            "function": {
                "name": name, "description": "Echo the text back.",
                "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]},
            },
        }  # fmt: skip
        from verl_agent.tools import OpenAIFunctionToolSchema

        super().__init__({}, OpenAIFunctionToolSchema.model_validate(schema))
        self.delay, self.fail, self.text_len = delay, fail, text_len
        self.created = self.released = self.running = self.peak = 0

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> str:
        self.created += 1
        return await super().create(instance_id, **kwargs)

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any):
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            await asyncio.sleep(self.delay)
            if self.fail:
                raise RuntimeError("echo broke")
            text = parameters["text"] * max(1, self.text_len // max(1, len(parameters["text"])))
            return ToolResponse(text=text), 0.25, {}
        finally:
            self.running -= 1

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return 0.5

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self.released += 1


def random_qwen2(vocab: int = 96, layers: int = 2, seed: int = 0):
    """A random Qwen2 built from a config (real transformers code, no download)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        eos_token_id=1, pad_token_id=0, tie_word_embeddings=True,
    )  # fmt: skip
    return Qwen2ForCausalLM(cfg).eval()


async def wait_for(cond, timeout: float = 60.0) -> None:
    """Poll `cond` on the running event loop until it holds (fails after `timeout` seconds)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        assert loop.time() < end, "timed out"
        await asyncio.sleep(0.001)
