"""The engine's own decode step (decode_step.py) against transformers' forward, on CPU with real models of
each family it takes: the same logits, fused projections or not, and one compiled graph for all layers."""

from __future__ import annotations

import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)  # fmt: skip

from verl_agent.engine.runner.arena import ParamArena
from verl_agent.engine.backends.hf_engine import _cache_kw
from verl_agent.engine.runner.decode_step import DecodeStep, fusion_groups
from verl_agent.engine.runner.kv_pool import KVBudget
from verl_agent.engine.runner.lora import LoRALinear, apply_adapters
from verl_agent.engine.runner.model_runner import ModelRunner

SHAPE = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, rms_norm_eps=1e-5)  # fmt: skip
FAMILIES = {
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**SHAPE)),  # q/k/v biases
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**SHAPE, attention_bias=True)),  # o_proj bias too
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**SHAPE, head_dim=32)),  # q/k norms, wider heads
    "mistral": lambda: MistralForCausalLM(MistralConfig(**SHAPE, sliding_window=None)),
}


def _model(family: str, dtype: torch.dtype, arena: bool):
    torch.manual_seed(0)
    model = FAMILIES[family]().eval().to(dtype)
    with torch.no_grad():  # biases are zero at init: make them count
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0, 0.5)
    if arena:  # the engine's own weights: q/k/v and gate/up back to back
        assert ParamArena.adopt(model, torch.device("cpu"), fusion_groups(model)) is not None
    return model


def _adapt(model, rank: int = 4, head: bool = False) -> None:
    """Unmerged adapters (random A and B, so they count) on every projection of every layer, and the LM head."""
    gen = torch.Generator().manual_seed(1)
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and (head or n != "lm_head")]
    adapters = {}
    for n in names:
        out_f, in_f = model.get_submodule(n).weight.shape
        a, b = torch.randn(rank, in_f, generator=gen), torch.randn(out_f, rank, generator=gen)
        adapters[n] = {"A": a * 0.3, "B": b * 0.3}
    assert apply_adapters(model, adapters, "unmerged") == len(names)


def _logits(model, own: bool) -> torch.Tensor:
    """Prefill two prompts, then six decode steps of four rows (two idle): every step's logits of the busy rows."""
    runner = ModelRunner(model, KVBudget(4, 64, 0, 0), pad_id=0, cache_kw=_cache_kw(model), cuda_graphs=False)
    assert runner.decode_step is not None
    if not own:
        runner.decode_step = None
    steps = [runner.prefill([(0, [5, 6, 7], 0), (1, [8, 9], 0)])]
    ids, pos = [10, 11, 0, 0], [3, 2, 0, 0]
    for _ in range(6):
        out = runner.decode(4, ids, pos, [1, 1, 0, 0])
        steps.append(out[:2])
        ids = out.argmax(-1).tolist()
        pos = [pos[0] + 1, pos[1] + 1, 0, 0]
    return torch.stack(steps)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("arena", [False, True], ids=["separate", "back-to-back"])
def test_the_decode_step_computes_the_models_own_logits(family, arena):
    """fp32: bit for bit what transformers' forward gives over the same slot pool, with the projections
    read one by one or (weights back to back in the engine's arena) as one fused product."""
    model = _model(family, torch.float32, arena)
    step = DecodeStep.of(model, fused_norms=True)
    fused = len(step.tensors(step.layers[0])[1]) == 1
    assert fused == arena
    torch.testing.assert_close(_logits(model, own=True), _logits(model, own=False), rtol=0, atol=0)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
@pytest.mark.parametrize("arena", [False, True], ids=["separate", "back-to-back"])
def test_unmerged_lora_adapters_run_in_the_decode_step(family, arena):
    """The engine's unmerged LoRA (LoRALinear on every projection and the LM head): the step reads the adapters
    with the weights and still gives, in fp32, bit for bit what transformers' forward through LoRALinear gives;
    zeroed adapters give the base model's logits."""
    model = _model(family, torch.float32, arena)
    base = _logits(model, own=True)
    _adapt(model, head=True)
    step = DecodeStep.of(model, fused_norms=True)
    assert step.applies() and isinstance(model.model.layers[0].self_attn.k_proj, LoRALinear)
    ours = _logits(model, own=True)
    torch.testing.assert_close(ours, _logits(model, own=False), rtol=0, atol=0)
    assert (ours - base).abs().max() > 0.1  # the adapters change the logits
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoRALinear):
                m.lora_B.zero_()
    torch.testing.assert_close(_logits(model, own=True), base, rtol=1e-6, atol=1e-6)


def test_a_projection_of_another_class_sends_the_step_to_transformers_forward():
    class Quantized(torch.nn.Linear):  # a stand-in for any layer whose forward the step does not reproduce
        pass

    model = _model("qwen2", torch.float32, arena=False)
    step = DecodeStep.of(model, fused_norms=True)
    assert step.applies()
    model.model.layers[2].mlp.up_proj.__class__ = Quantized
    assert not step.applies()


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_in_bf16_the_decode_step_stays_within_rounding_of_the_models_forward(family):
    model = _model(family, torch.bfloat16, arena=True)
    ours, theirs = _logits(model, own=True), _logits(model, own=False)
    torch.testing.assert_close(ours, theirs, rtol=0.02, atol=0.02)


def test_models_it_does_not_reproduce_keep_transformers_forward():
    """Another activation, an MLP bias or norms of different eps: no decode step of ours (None)."""
    assert DecodeStep.of(Qwen2ForCausalLM(Qwen2Config(**SHAPE, hidden_act="gelu")), fused_norms=True) is None
    assert DecodeStep.of(LlamaForCausalLM(LlamaConfig(**SHAPE, mlp_bias=True)), fused_norms=True) is None
    model = Qwen2ForCausalLM(Qwen2Config(**SHAPE))
    model.model.layers[1].input_layernorm.variance_epsilon = 1e-3
    assert DecodeStep.of(model, fused_norms=True) is None
    assert DecodeStep.of(Qwen2ForCausalLM(Qwen2Config(**SHAPE)), fused_norms=True) is not None


@pytest.mark.parametrize("lora", [False, True], ids=["plain", "unmerged-lora"])
def test_one_compiled_graph_serves_every_layer(monkeypatch, lora):
    """Compiled, the layer function is traced once for all layers of a bucket (a whole-model compile traces
    each layer anew), unmerged adapters included; a second bucket adds one graph with dynamic sizes, a third
    none."""
    from verl_agent.engine.runner import model_runner

    compiles = []

    def backend(gm, example_inputs):
        compiles.append(len(gm.graph.nodes))
        return gm.forward

    compile_ = torch.compile
    monkeypatch.setattr(model_runner.torch, "compile", lambda fn, **kw: compile_(fn, backend=backend, **kw))
    torch._dynamo.reset()
    model = _model("qwen2", torch.float32, arena=True)
    model.config.num_hidden_layers = 3
    if lora:
        _adapt(model)
    runner = ModelRunner(model, KVBudget(16, 64, 0, 0), pad_id=0, cache_kw=_cache_kw(model), cuda_graphs=False,
                         compile_decode=True)  # fmt: skip
    assert runner.decode_model is model  # transformers' forward is not compiled
    runner.prefill([(s, [5, 6, 7], 0) for s in range(16)])
    for rows in (4, 4, 8, 16):
        runner.decode(rows, [9] * rows, [3] * rows, [1] * rows)
    assert len(compiles) == 2, compiles


def test_the_decode_step_records_nothing_for_autograd():
    """Called with grad enabled (a graph capture outside the engine's no_grad decode, a borrowed actor's
    weights that require grad), the step still builds no autograd graph: compiled, it is an inference graph."""
    model = _model("qwen2", torch.float32, arena=False)
    assert all(p.requires_grad for p in model.parameters())
    runner = ModelRunner(model, KVBudget(4, 64, 0, 0), pad_id=0, cache_kw=_cache_kw(model), cuda_graphs=False)
    runner.prefill([(0, [5, 6, 7], 0)])
    pool = runner.ensure_pool()
    pool.ensure_clean(64)
    with torch.enable_grad():
        ids, pos = torch.tensor([9, 0]), torch.tensor([3, 0])
        out = runner.decode_step(ids, pos, pos, runner._mask(torch.ones(2, 1, 64, dtype=torch.bool)), pool.k, pool.v,
                                 pool.row_ids[:2])  # fmt: skip
    assert not out.requires_grad and out.grad_fn is None
