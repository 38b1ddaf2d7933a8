"""The memory planner (verl_agent/trainer/policy/memory.py): its estimate by term, its choice of micro-batch and KV
budgets on this machine for the calculator and SmolLM2 examples, its refusal of what cannot fit, and a short
real run of the calculator example whose train ranks' measured peak RSS is set against their estimates.

bench/memory.py runs every documented CPU command this way for 2 steps; this is its cheapest variant.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

from verl_agent.config import load_config
from verl_agent.trainer.policy import memory
from verl_agent.trainer.policy.memory import MemoryPlanError, ModelShape, estimate, plan_memory

REPO = Path(__file__).resolve().parents[2]
# SmolLM2-135M-Instruct's shape (what `verl-agent model build-smollm2` converts); the planner reads only shapes,
# so the tests build it on the meta device: no download, no 0.5 GB of weights.
SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=8192)
# examples/smollm2_calculator/README.md's command "GRPO from the warm start, on 2 CPU cores"
SMOLLM2_CPU = ["trainer.n_gpus_per_node=0", "trainer.num_cpu_workers=1", "data.train_batch_size=4",
               "actor_rollout_ref.rollout.n=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
               "data.max_response_length=96", "actor_rollout_ref.actor.optim.lr=2e-5"]


def _smollm2() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        return LlamaForCausalLM(LlamaConfig(**SMOLLM2))


def _bench():
    spec = importlib.util.spec_from_file_location("bench_memory", REPO / "bench" / "memory.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_estimate_terms_follow_the_shape():
    model = _smollm2()
    shape = ModelShape.of(model.config, sum(p.numel() for p in model.parameters()))
    assert shape.params == ModelShape.of(model.config).params == 134_515_008  # the count from the shape alone
    e = estimate(shape, 4096)
    assert e.weights == e.grads == shape.params * 4 and e.optimizer == 2 * shape.params * 4
    # 30 layers x (6 x 576 + 3 x 576 + 2 x 576 (K/V repeated to 9 heads) + 4 x 1536) fp32 values, one layer more
    # for the backward, + 4 x 576
    assert e.activations == 4096 * 4 * (31 * 12480 + 4 * 576)
    # one 2048-row chunk's two fp32 buffers, never [tokens, vocab]; the head's fp32 gradient and a product of it
    assert e.logits == 2 * 2048 * 49152 * 4 + 49152 * 576 * (4 + 4)
    assert e.total == sum([e.runtime, e.weights, e.grads, e.optimizer, e.activations, e.logits, e.engine, e.kv])
    ckpt = estimate(shape, 4096, grad_ckpt=True)
    assert ckpt.activations * 5 < e.activations  # only layer inputs kept, one layer recomputed at a time
    two = estimate(shape, 4096, world=2)
    assert two.optimizer == e.optimizer // 2 and e.weights / 2 < two.weights < e.weights  # shards + gathered layer
    plain = estimate(shape, 4096, fused_head=False)
    assert plain.logits > 4096 * 49152 * 4  # the full logits exist


def test_lora_estimate_trains_the_adapters_alone():
    """LoRA at the 7B shape, rank 32 on every linear layer: a bf16 base with no gradients and no AdamW moments
    (fp32 adapters carry both), and no reference copy, against the full fine-tune with its reference."""
    from transformers import Qwen2Config

    config = Qwen2Config(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                         num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False)
    base = ModelShape.of(config)
    adapters = 28 * 32 * (2 * (3584 + 3584) + 2 * (3584 + 512) + 3 * (3584 + 18944))  # q, o; k, v; gate, up, down
    assert adapters == 80_740_352
    full = estimate(base, 4096, param_bytes=4, act_bytes=2, grad_ckpt=True, extra_models=1)
    shape = ModelShape.of(config, base.params + adapters)
    lora = estimate(shape, 4096, param_bytes=2, grad_ckpt=True, trainable=adapters)
    assert lora.weights == 2 * base.params + 4 * adapters
    assert (lora.grads, lora.optimizer) == (4 * adapters, 8 * adapters)
    assert full.weights == 2 * 4 * base.params and full.optimizer == 8 * base.params
    assert lora.total - lora.activations - lora.logits < 17 * 2**30 < 84 * 2**30 < full.total - full.activations


def _fits_exactly(plan, cfg, model) -> None:
    """The budget is the largest that fits: one more token would pass the room, unless the upper bound cut it."""
    assert plan.peak.total <= plan.room
    upper = cfg.actor_rollout_ref.actor.ppo_max_token_len_per_gpu
    if plan.max_tokens < upper:
        shape = ModelShape.of(model.config, sum(p.numel() for p in model.parameters()))
        over = estimate(shape, plan.max_tokens + 1, runtime=plan.peak.runtime, engine_bytes=plan.peak.engine,
                        kv_bytes=plan.peak.kv)
        assert over.total > plan.room


def test_planner_fits_smollm2_cpu_command_on_this_machine():
    cfg = load_config(REPO / "examples/smollm2_calculator/config.yaml",
                      ["actor_rollout_ref.model.path=smollm2", *SMOLLM2_CPU])
    model = _smollm2()
    try:
        plan = plan_memory(cfg, model, torch.device("cpu"))
    except MemoryPlanError as e:  # other work holds this machine's memory now: the refusal must be right
        assert e.need > e.room and e.room < 8 * 2**30
        pytest.skip(f"only {e.room / 2**30:.1f} GiB available to plan with now")
    longest = cfg.actor_rollout_ref.rollout.max_model_len  # 1024: one whole conversation
    assert longest <= plan.max_tokens <= 16384
    _fits_exactly(plan, cfg, model)
    total = memory.device_memory_bytes(torch.device("cpu"))
    # the room leaves the margin free, so a rank never plans past 80 % of RAM
    assert plan.room <= memory.process_rss_bytes() + (1 - memory.MARGIN["cpu"]) * total
    # the engine's KV: at least one longest slot, at most what rollout.gpu_memory_utilization gives it
    assert 1025 * 2 * 30 * 3 * 64 * 4 <= plan.kv_cache_bytes <= 0.3 * total
    assert plan.peak.activations == plan.max_tokens * memory.activation_bytes_per_token(
        ModelShape.of(model.config), 4, False)


def test_planner_fits_calculator_example_and_refuses_what_cannot_fit(tiny_model_path, monkeypatch):
    from verl_agent.trainer.policy.fsdp import load_causal_lm

    cfg = load_config(REPO / "examples/calculator/config.yaml", [f"actor_rollout_ref.model.path={tiny_model_path}"])
    model = load_causal_lm(str(tiny_model_path))
    plan = plan_memory(cfg, model, torch.device("cpu"))
    assert plan.max_tokens == 16384  # the tiny model fits the upper bound
    assert plan.peak.runtime > 0 and plan.peak.total <= plan.room

    # Hosts with 1 GiB and 12 GiB available beyond the margin: patched, since this machine's free memory
    # cannot be set (and moves with other work).
    def available(gib: int):
        return lambda device: int(memory.MARGIN["cpu"] * memory.device_memory_bytes(device)) + gib * 2**30

    monkeypatch.setattr(memory, "device_available_bytes", available(1))
    cfg = load_config(REPO / "examples/smollm2_calculator/config.yaml",
                      ["actor_rollout_ref.model.path=smollm2", *SMOLLM2_CPU,
                       "actor_rollout_ref.rollout.max_model_len=4096"])
    with pytest.raises(MemoryPlanError) as err:
        plan_memory(cfg, _smollm2(), torch.device("cpu"))
    msg = str(err.value)
    assert "enable_gradient_checkpointing=true" in msg and "max_model_len" in msg and "GiB" in msg
    cfg = load_config(REPO / "examples/smollm2_calculator/config.yaml",
                      ["actor_rollout_ref.model.path=smollm2", *SMOLLM2_CPU,
                       "actor_rollout_ref.actor.use_dynamic_bsz=false",
                       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=64"])
    monkeypatch.setattr(memory, "device_available_bytes", available(12))
    with pytest.raises(MemoryPlanError, match="ppo_micro_batch_size_per_gpu"):
        plan_memory(cfg, _smollm2(), torch.device("cpu"))


def test_calculator_example_runs_within_its_estimate(ray_cluster, tiny_model_path, tmp_path):
    """One real step of examples/calculator/config.yaml (2 gloo ranks, its 8 prompts x 16 samples): the train
    ranks' peak RSS (the kernel's high-water mark) is within 25 % of their plans' estimate (mean of the two
    ranks: one rank's peak alone moves by about 15 % between runs). Shared prefixes are switched on (the
    tiny model's default leaves them off): the estimate holds for packed rows, and the key reaches the update."""
    from verl_agent.trainer.loop import train

    cfg = load_config(REPO / "examples/calculator/config.yaml", [
        f"actor_rollout_ref.model.path={tiny_model_path}", "trainer.total_training_steps=1", "data.val_files=[]",
        "trainer.val_before_train=false", "trainer.save_freq=-1", "trainer.logger=[console]",
        f"trainer.default_local_dir={tmp_path}", "actor_rollout_ref.actor.shared_prefix_min_tokens=32"])
    with _bench().Peaks(os.getpid()) as peaks:
        result = train(cfg)
    assert len(result.history) == 1
    widest = result.history[0]["perf/max_micro_batch_tokens"]  # the update's largest micro-batch (mean of ranks)
    assert result.history[0]["perf/update_tokens_shared"] > 0.2 * result.history[0]["perf/update_tokens"]
    est = measured = 0.0
    for w in result.workers:
        plan = w["memory_plan"]
        assert plan["max_tokens"] == 16384 and 0 < widest <= plan["max_tokens"]
        # the plan's estimate with the activations of the micro-batch that ran instead of the full budget
        est += plan["peak_estimate"] - plan["activations"] * (1 - widest / plan["max_tokens"])
        measured += peaks.hwm[w["pid"]]
    print(f"estimate / measured peak: {est / measured:.3f}")
    assert abs(est / measured - 1) <= 0.25, (measured / 2**30, est / 2**30)


def test_a_slot_holds_what_the_budgets_let_one_segment_reach(tiny_model_path):
    """rollout.max_model_len unset: prompt + response budget (verl's default), the context cap where it is
    larger, one more response budget where a segment restarts from a rewritten history (a context strategy, an
    agent function); the model's limit caps it; the engine the trainer builds gets exactly that."""
    import asyncio

    from verl_agent.rollout.build import build_rollout

    calc = REPO / "examples/calculator/config.yaml"  # 256 + 96
    mt = "actor_rollout_ref.rollout.multi_turn"
    assert load_config(calc).slot_tokens == 352
    assert load_config(calc, [f"{mt}.max_context_length=1000"]).slot_tokens == 1000
    assert load_config(calc, [f"{mt}.max_context_length=1000", f"{mt}.context.strategy=drop_observations"]
                       ).slot_tokens == 1000 + 96
    agent = "actor_rollout_ref.rollout.agent.entrypoint=examples/openai_agent/agent.py:run_agent"
    assert load_config(calc, [agent]).slot_tokens == 352 + 96
    assert load_config(calc, ["actor_rollout_ref.rollout.max_model_len=300"]).slot_tokens == 300
    assert memory.longest_sequence(load_config(calc), type("Config", (), {"max_position_embeddings": 320})()) == 320
    parts = build_rollout(load_config(calc, [f"actor_rollout_ref.model.path={tiny_model_path}"]), device="cpu")
    try:
        assert parts.engine.metrics()["engine/kv_tokens_per_slot"] == 352
    finally:
        asyncio.run(parts.engine.close())


def test_trained_length_is_the_data_budget_and_a_sleeping_gpu_engine_leaves_the_update_its_weights():
    """A step trains on at most prompt + response budget tokens (a slot may be longer); on a GPU a sleeping
    engine has dropped its weights during the update, so they are not counted there (on CPU they are)."""
    cfg = load_config(REPO / "examples/calculator/config.yaml", ["actor_rollout_ref.rollout.max_model_len=4096"])
    config = type("Config", (), {"max_position_embeddings": 32768})()
    assert memory.longest_sequence(cfg, config) == 4096
    assert memory.longest_trained(cfg, config) == 256 + 96
    inputs = dict(shape=None, kw={}, room=0, longest=4096, trained=352, engine_bytes=7, engine_transient=3,
                  kv_full=0, kv_min=0, kv_share=0)
    assert memory._engine_in_update(memory._Inputs(**inputs, engine_sleeps=True, drops_weights=True)) == 0
    assert memory._engine_in_update(memory._Inputs(**inputs, engine_sleeps=True)) == 7
    assert memory._engine_in_update(memory._Inputs(**inputs, engine_sleeps=False)) == 7  # sync: not generating
    assert memory._engine_in_update(memory._Inputs(**inputs, engine_sleeps=False, generates_in_update=True)) == 10
