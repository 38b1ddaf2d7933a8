"""LoRA RL (actor_rollout_ref.model.lora_rank > 0): only the adapters train, the reference is the base bit for
bit, a resume is exact, the export loads in PEFT, and on 2 FSDP2 ranks a verl YAML's adapters reach the
engine (adapter bytes only) with engine log-probs equal to the actor's.

Real components: the tiny model, PEFT, FSDP2 on gloo (one rank in this process; two Ray workers in the
last test), a real HFEngine replica per rank.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml

from verl_agent.config import ConfigError, load_config

LORA = ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8"]


def _trained(policy, seqs, step: int):
    policy.compute_log_probs(seqs, n_minibatches=1)  # the reference log-probs of the KL loss
    for s in seqs:
        s.advantages = torch.linspace(-1, 1, s.response_len)
    return policy.update(seqs, n_minibatches=1, step=step)


def _state(policy) -> dict[str, torch.Tensor]:
    """Adapters and their AdamW moments, by name (copies)."""
    params = dict(policy.actor.named_parameters())
    out = {n: p.detach().clone() for n, p in params.items() if p.requires_grad}
    for n, p in params.items():
        for k, v in policy.optim.state.get(p, {}).items():
            out[f"{n}/{k}"] = v.detach().clone()
    return out


def test_lora_policy(make_cfg, tiny_model_path, one_rank, random_seqs, tmp_path):
    from peft import PeftModel

    from verl_agent.trainer.persistence import checkpoint as ckpt
    from verl_agent.trainer.policy.actor import forward_log_probs
    from verl_agent.trainer.policy.fsdp import load_causal_lm
    from verl_agent.trainer.policy.policy import Policy

    cfg = make_cfg(*LORA, "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.1",
                   "actor_rollout_ref.actor.optim.lr=1e-2", "trainer.num_cpu_workers=1")
    policy = Policy(cfg, 0, torch.device("cpu"), one_rank, str(tiny_model_path))
    assert policy.ref is None  # the reference is the actor with its adapters disabled
    trainable = [n for n, p in policy.actor.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    linear = [m for n, m in load_causal_lm(str(tiny_model_path)).named_modules()
              if isinstance(m, torch.nn.Linear) and n != "lm_head"]  # all-linear: every decoder linear layer
    assert policy.num_trainable_parameters == sum(4 * (m.in_features + m.out_features) for m in linear)
    n_adapter = policy.num_trainable_parameters
    peak = policy.memory.peak  # the plan knows: gradients and moments of the adapters alone, no reference copy
    assert (peak.grads, peak.optimizer) == (4 * n_adapter, 8 * n_adapter)
    assert peak.weights == 4 * policy.num_parameters
    frozen = {n: p.detach().clone() for n, p in policy.actor.named_parameters() if not p.requires_grad}
    seqs = random_seqs(6, 300)
    for s in seqs:  # the engine's log-probs, which the log-prob metrics set against the actor's
        s.rollout_log_probs = torch.full((s.response_len,), -5.0)
    _trained(policy, seqs, 1)
    assert len(policy.optim.state) == len(trainable)  # AdamW moments for the adapters alone
    assert all(torch.equal(p, frozen[n]) for n, p in policy.actor.named_parameters() if not p.requires_grad)
    assert all(float(p.detach().abs().sum()) > 0 for n, p in policy.actor.named_parameters() if ".lora_B." in n)

    policy.compute_log_probs(seqs, n_minibatches=2)  # several mini-batches: an actor pass for the old log-probs
    base = load_causal_lm(str(tiny_model_path)).eval()
    with torch.no_grad():
        expected, _ = forward_log_probs(base, seqs, 1.0, torch.device("cpu"))
    for s, e in zip(seqs, expected):
        assert torch.equal(s.ref_log_probs, e.float())  # bit for bit: the base, adapters disabled
        assert not torch.equal(s.old_log_probs, s.ref_log_probs)  # the trained adapters change the policy

    ckpt.save_policy(policy, tmp_path / "ckpt", "none", 0)
    files = sum(f.stat().st_size for f in (tmp_path / "ckpt").rglob("*.bin"))
    assert files < 3 * 4 * policy.num_trainable_parameters + 65536  # adapters + 2 moments, no base weights
    saved = _state(policy)
    _trained(policy, seqs, 2)
    after_one = _state(policy)
    ckpt.load_policy(policy, tmp_path / "ckpt", 0)
    assert all(torch.equal(v, saved[k]) for k, v in _state(policy).items())
    _trained(policy, seqs, 2)
    assert all(torch.equal(v, after_one[k]) for k, v in _state(policy).items())  # the resumed step is the same

    out = ckpt.export_lora(policy.actor, str(tiny_model_path), str(tiny_model_path), tmp_path / "hf", 0,
                           merged_dir=tmp_path / "merged")
    assert sorted(p.name for p in Path(out).glob("adapter_*")) == ["adapter_config.json", "adapter_model.safetensors"]
    loaded = PeftModel.from_pretrained(load_causal_lm(str(tiny_model_path)), out).eval()
    merged = load_causal_lm(str(tmp_path / "merged")).eval()
    policy.actor.eval()
    with torch.no_grad():
        ours, _ = forward_log_probs(policy.actor, seqs, 1.0, torch.device("cpu"))
        theirs, _ = forward_log_probs(loaded, seqs, 1.0, torch.device("cpu"))
        flat, _ = forward_log_probs(merged, seqs, 1.0, torch.device("cpu"))
    for a, b, c in zip(ours, theirs, flat):
        assert torch.allclose(a, b, atol=1e-5) and torch.allclose(a, c, atol=1e-4)


def test_lora_config_errors(make_cfg, tiny_model_path, one_rank, tmp_path):
    from peft import LoraConfig, get_peft_model

    from verl_agent.trainer.policy.fsdp import load_causal_lm
    from verl_agent.trainer.policy.policy import Policy

    with pytest.raises(ConfigError, match="lora_rank.*greater than or equal to 0"):
        make_cfg("actor_rollout_ref.model.lora_rank=-1")
    with pytest.raises(ConfigError, match="target_modules.*only LoRA reads it"):
        make_cfg("actor_rollout_ref.model.target_modules=[q_proj]")
    with pytest.raises(ConfigError, match="export_merged_model.*without LoRA"):
        make_cfg("trainer.export_merged_model=true")
    with pytest.raises(ConfigError, match="lora_rank.*use actor_rollout_ref.rollout.name=hf"):
        make_cfg(*LORA, "actor_rollout_ref.rollout.name=sglang")
    cfg = make_cfg(*LORA, "actor_rollout_ref.model.target_modules=[q_proj,qkv_proj]", "trainer.num_cpu_workers=1")
    with pytest.raises(ConfigError, match=r"target_modules: \['qkv_proj'\] name no module.*'q_proj'"):
        Policy(cfg, 0, torch.device("cpu"), one_rank, str(tiny_model_path))
    cfg = make_cfg(*LORA, "actor_rollout_ref.model.lora_adapter_path=/nonexistent", "trainer.num_cpu_workers=1")
    with pytest.raises(ConfigError, match="lora_adapter_path.*no adapter_config.json"):
        Policy(cfg, 0, torch.device("cpu"), one_rank, str(tiny_model_path))
    adapter = tmp_path / "adapter"
    get_peft_model(load_causal_lm(str(tiny_model_path)), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"])
                   ).save_pretrained(adapter)
    for extra, match in [("actor_rollout_ref.model.lora_alpha=16", r"lora_alpha=8, but .*lora_alpha=16"),
                         ("actor_rollout_ref.model.target_modules=[q_proj,v_proj]",
                          "4 configured adapter tensors missing")]:
        cfg = make_cfg(*LORA, extra, f"actor_rollout_ref.model.lora_adapter_path={adapter}",
                       "trainer.num_cpu_workers=1")
        with pytest.raises(ConfigError, match=match):
            Policy(cfg, 0, torch.device("cpu"), one_rank, str(tiny_model_path))


@pytest.mark.slow
def test_lora_yaml_on_two_ranks_syncs_adapters_only(ray_cluster, make_cfg, random_seqs, tmp_path):
    """A verl-style YAML with the LoRA keys, 2 FSDP2 ranks, starting from an adapter folder
    (lora_adapter_path: the engines get it before the first rollout): an update, then the sync moves the
    adapters alone (their bytes in the engine's dtype) and each rank's engine samples with the actor's
    log-probs."""
    from peft import LoraConfig, get_peft_model

    from verl_agent.trainer.policy.fsdp import load_causal_lm
    from verl_agent.trainer.workers.controller import WorkerGroup
    from verl_agent.trainer.workers.sharding import shard_list
    from worker_probes import check_sync, set_sequences

    tree = make_cfg().model_dump(mode="json")
    start = get_peft_model(load_causal_lm(tree["actor_rollout_ref"]["model"]["path"]),
                           LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", exclude_modules=["o_proj"]))
    with torch.no_grad():  # B != 0: an engine without the adapter would sample from another policy
        for n, p in start.named_parameters():
            if ".lora_B." in n:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(n)))
    start.save_pretrained(tmp_path / "start")
    tree["actor_rollout_ref"]["model"].update(lora_rank=8, lora_alpha=16, target_modules="all-linear",
                                              exclude_modules=["o_proj"], lora_adapter_path=str(tmp_path / "start"))
    tree["actor_rollout_ref"]["actor"].update(use_kl_loss=True, kl_loss_coef=0.01)
    path = tmp_path / "lora.yaml"
    path.write_text(yaml.safe_dump(tree))
    cfg = load_config(path)
    group = WorkerGroup.create(cfg)
    try:
        prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17]]
        assert max(check_sync(group, prompts)) < 1e-4  # the engines hold the starting adapter
        start_b = {n: p for n, p in start.named_parameters() if ".lora_B." in n}
        actor_b = group.run(lambda w: {n: p.full_tensor().clone() for n, p in w.policy.actor.named_parameters()
                                       if ".lora_B." in n})[0]
        assert actor_b.keys() == start_b.keys() and all(torch.equal(actor_b[n], start_b[n]) for n in start_b)
        seqs = random_seqs(8, 300)
        for s in seqs:
            s.advantages = torch.randn(s.response_len)
        set_sequences(group, shard_list(seqs, group.world_size))
        group.compute_log_probs(n_minibatches=1)
        assert all(m["grad_norm"] > 0 for m in group.update(n_minibatches=1, step=1, update_actor=True))
        assert group.sync_weights(version=1) >= 0
        adapters = group.run(lambda w: w.policy.num_trainable_parameters)[0]
        assert group.sync_bytes == adapters * 4  # fp32 engine: the adapters' bytes, nothing of the base
        assert max(check_sync(group, prompts)) < 1e-4
    finally:
        group.shutdown()


def test_fresh_adapters_reach_the_engine_before_the_first_rollout(ray_cluster, make_cfg):
    """Unmerged adapters are installed at start-up, not at the first sync after step 1: the first decode
    graphs then hold their matmuls, and the second step records none again."""
    from verl_agent.engine.runner.lora import LoRALinear
    from verl_agent.trainer.workers.controller import WorkerGroup

    group = WorkerGroup.create(make_cfg(*LORA, "trainer.num_cpu_workers=1",
                                        "actor_rollout_ref.rollout.lora_mode=unmerged"))
    try:
        installed = group.run(lambda w: sum(isinstance(m, LoRALinear) for m in w.rollout.engine.model.modules()))
        targets = group.run(lambda w: sum(".lora_A." in n for n, _ in w.policy.actor.named_parameters()))
        assert installed == targets and targets[0] > 0
    finally:
        group.shutdown()


def test_reference_pass_then_update_under_gpu_mixed_precision(tiny_model_path, one_rank):
    """The GPU layout (bf16 base, fp32 adapters, FSDP2 bf16 compute with fp32 gradient reduction) on CPU:
    `shard(..., "cuda")` picks that mixed-precision policy (no GPU here). A reference pass, then a backward,
    must give the adapters fp32 gradients, and the reference equals the base with the adapters at zero."""
    from verl_agent.trainer.policy.fsdp import load_causal_lm, shard
    from verl_agent.trainer.weights.lora import reference_of, wrap_lora

    model_cfg = load_config(None, LORA).actor_rollout_ref.model
    model = shard(wrap_lora(load_causal_lm(str(tiny_model_path), "bfloat16"), model_cfg), one_rank, "cuda")
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_B." in n:
                p.to_local().normal_(0, 0.1, generator=torch.Generator().manual_seed(0))
    ids = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), reference_of(model):
        ref = model(input_ids=ids).logits
    model(input_ids=ids).logits.float().sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all(g is not None and g.dtype == torch.float32 for g in grads.values())
    base = load_causal_lm(str(tiny_model_path), "bfloat16").eval()
    with torch.no_grad():
        assert torch.equal(ref, base(input_ids=ids).logits)
        assert not torch.equal(model(input_ids=ids).logits, ref)  # the adapters count again after the block


def test_engine_reads_the_trainers_base_on_one_rank(make_cfg, tiny_model_path, one_rank, random_seqs):
    """One train rank, unmerged adapters: the colocated engine's parameters are the actor's frozen base tensors
    (no copy), through a sleep, an update and a sync, and it samples the actor's policy."""
    from types import SimpleNamespace

    from verl_agent.trainer.policy.policy import Policy
    from verl_agent.trainer.workers.rollout_worker import RolloutHost
    from verl_agent.trainer.weights.weight_transport import WeightSender
    from verl_agent.trainer.weights.shared_weights import actor_tensors, engine_shares_weights
    from verl_agent.trainer.policy import memory
    from worker_probes import _max_log_prob_gap

    cfg = make_cfg(*LORA, "trainer.num_cpu_workers=1", "actor_rollout_ref.rollout.lora_mode=unmerged",
                   "actor_rollout_ref.rollout.free_cache_engine=true", "actor_rollout_ref.actor.optim.lr=1e-2")
    assert engine_shares_weights(cfg, "cpu", 1) and not engine_shares_weights(cfg, "cpu", 2)
    device = torch.device("cpu")
    policy = Policy(cfg, 0, device, one_rank, str(tiny_model_path))
    planned = memory._inputs(cfg, policy.actor, device, [policy.actor])
    assert planned.engine_bytes == 4 * policy.num_trainable_parameters  # the engine's adapters, no second base
    host = RolloutHost(cfg, 0, str(tiny_model_path), device, shards=1, kv_cache_bytes=policy.memory.kv_cache_bytes,
                       shared_weights=actor_tensors(policy.actor, frozen_only=True))
    try:
        base = actor_tensors(policy.actor, frozen_only=True)
        engine = dict(host.engine.model.named_parameters())
        assert engine.keys() == base.keys() and all(engine[n].data_ptr() == t.data_ptr() for n, t in base.items())
        host.sleep()  # the sync loop's sleep (rollout.free_cache_engine) leaves the base where it is
        seqs = random_seqs(6, 300)
        for s in seqs:
            s.advantages = torch.linspace(-1, 1, s.response_len)
        policy.update(seqs, n_minibatches=1, step=1)
        WeightSender(0, device).to_local_engine(host, policy.engine_weights(), drain=True, version=1, previous=0)
        worker = SimpleNamespace(rollout=host, policy=policy, device=device)
        assert _max_log_prob_gap(worker, [[5, 6, 7, 8], [9, 10, 11]], 12) < 1e-4
        assert all(engine[n].data_ptr() == t.data_ptr() for n, t in base.items())
    finally:
        host.close()


@pytest.mark.slow
def test_lora_leaves_async_partial_rollouts_openai_agents_turn_credit_and_the_viewer_as_they_are(
        ray_cluster, make_cfg, tmp_path):
    """LoRA on, everything else unchanged: the async mode with partial rollouts (max_staleness 1), an agent
    written on the `openai` SDK (examples/openai_agent) through the recording endpoint, the grpo_turn
    estimator, and the run read back by the viewer. Every sync moves the adapters alone."""
    from verl_agent.trainer.loop import train
    from verl_agent.viewer.run import Run

    run = tmp_path / "run"
    result = train(make_cfg(*LORA, "trainer.mode=async", "trainer.max_staleness=1", "trainer.partial_rollout=true",
                            "actor_rollout_ref.rollout.agent.entrypoint=examples/openai_agent/agent.py:run_agent",
                            "algorithm.adv_estimator=grpo_turn", "trainer.total_training_steps=3",
                            "data.max_response_length=48", "data.val_files=[]", "trainer.num_cpu_workers=1",
                            run_dir=run))
    hist = result.history
    assert len(hist) == 3 and all(math.isfinite(h["actor/pg_loss"]) for h in hist)
    adapters = result.workers[0]["trainable_parameters"]
    assert 0 < adapters and [h["perf/weight_sync_bytes"] for h in hist[1:]] == [adapters * 4] * 2  # fp32, no base
    lags = [h["rollout/policy_lag/max"] for h in hist]
    assert lags[:2] == [0.0, 1.0] and max(lags) == 1.0  # async: batch 2 started under the first weights
    assert sum(h["rollout/num_trajectories"] for h in hist) == 3 * 4 * 4  # 4 prompts x n=4, none lost
    viewer = Run(run)
    steps = [f for f in viewer.files() if f["kind"] == "train"]
    assert [f["step"] for f in steps] == [1, 2, 3]
    record = viewer.record(steps[-1]["id"], 0)
    assert len(record["advantages"]) == len(record["response_ids"]) == len(record["response_tokens"]) > 0
