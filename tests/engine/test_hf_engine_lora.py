"""LoRA adapters in the hf engine (engine/runner/lora.py): both modes give the policy W x + B (A x), merging never
drifts over many syncs, and bad adapter tensors are refused by name before anything changes.

The real tiny model in a real HFEngine; the expected policy is a PEFT model with the same adapters."""

from __future__ import annotations

import asyncio

import pytest
import torch

from verl_agent.engine.contract import SamplingParams
from verl_agent.engine.backends.hf_engine import HFEngine

LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _adapters(model, rank: int, seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for name, m in model.named_modules():
        if name.rsplit(".", 1)[-1] in LINEAR:
            out += [(f"{name}.lora_A.weight", torch.randn(rank, m.in_features, generator=g) * 0.1),
                    (f"{name}.lora_B.weight", torch.randn(m.out_features, rank, generator=g) * 0.1)]
    return out


def _peft_reference(path, adapters: list[tuple[str, torch.Tensor]], rank: int):
    """The policy the adapters stand for: PEFT's LoRA on the same base (scaling 1: B came pre-scaled)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(path)),
                           LoraConfig(r=rank, lora_alpha=rank, target_modules=list(LINEAR)))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, t in adapters:
            module, kind = name.rsplit(".", 2)[0], name.rsplit(".", 2)[1]
            params[f"base_model.model.{module}.{kind}.default.weight"].copy_(t)
    return model.eval()


def _engine_log_probs(engine: HFEngine, prompts: list[list[int]]) -> tuple[list, list]:
    sp = SamplingParams(temperature=1.0, max_new_tokens=12, seed=7)

    async def go():
        return await asyncio.gather(*(engine.generate(p, sp) for p in prompts))

    outs = asyncio.run(go())
    return [o.token_ids for o in outs], [torch.tensor(o.logprobs) for o in outs]


def _model_log_probs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1: -1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


@pytest.mark.parametrize("mode", ["merge", "unmerged"])
def test_engine_applies_adapters_as_peft_does(tiny_model_path, mode):
    engine = HFEngine(str(tiny_model_path), lora_mode=mode, max_num_seqs=4, max_model_len=64)
    try:
        base = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
        q = "model.layers.0.self_attn.q_proj"
        adapters = _adapters(engine.model, 4, 1)
        asyncio.run(engine.update_weights(adapters))
        first = engine.model.get_parameter(f"{q}.weight").detach().clone()
        for seed in [*range(2, 21), 1]:  # many syncs, then the first adapter again: no drift, bit for bit
            asyncio.run(engine.update_weights(_adapters(engine.model, 4, seed)))
        assert torch.equal(engine.model.get_parameter(f"{q}.weight"), first)
        reference = _peft_reference(tiny_model_path, adapters, 4)
        prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13]]
        tokens, logps = _engine_log_probs(engine, prompts)
        for p, t, lp in zip(prompts, tokens, logps):
            assert torch.allclose(lp, _model_log_probs(reference, p, t), atol=1e-4), mode
        a, b = dict(adapters)[f"{q}.lora_A.weight"], dict(adapters)[f"{q}.lora_B.weight"]
        weight = engine.model.get_parameter(f"{q}.weight").detach()
        if mode == "merge":  # base + B A of the last sync
            assert torch.allclose(weight, base[f"{q}.weight"] + b @ a, atol=1e-6)
        else:  # the base is untouched; the adapter lives beside it
            assert torch.equal(weight, base[f"{q}.weight"])
            assert torch.equal(engine.model.get_submodule(q).lora_B, b)
    finally:
        asyncio.run(engine.close())


def test_engine_refuses_bad_adapters_before_changing_anything(tiny_model_path):
    engine = HFEngine(str(tiny_model_path), max_num_seqs=2, max_model_len=32)
    try:
        before = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
        adapters = _adapters(engine.model, 4, 0)
        cases = [
            (adapters[:-1], ValueError, "needs lora_A and lora_B"),  # the last layer's B is missing
            ([*adapters[:-1], (adapters[-1][0], torch.zeros(3, 4))], ValueError, "has lora_A"),
            ([("model.layers.9.mlp.up_proj.lora_A.weight", torch.zeros(4, 8)),
              ("model.layers.9.mlp.up_proj.lora_B.weight", torch.zeros(8, 4))], KeyError, "model.layers.9"),
            ([("model.norm.lora_A.weight", torch.zeros(4, 8)), ("model.norm.lora_B.weight", torch.zeros(8, 4))],
             TypeError, "only linear layers"),
        ]
        for tensors, error, match in cases:
            with pytest.raises(error, match=match):
                asyncio.run(engine.update_weights(tensors))
        assert all(torch.equal(p, before[n]) for n, p in engine.model.named_parameters())
    finally:
        asyncio.run(engine.close())
