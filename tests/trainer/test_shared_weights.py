"""A full fine-tune on one train rank in sync mode: the colocated hf engine's parameters are the actor's own
tensors (trainer/weights/shared_weights.py). The optimizer's in-place step is the weight sync: it copies
nothing, and the engine then samples the updated policy, asleep in between or not. Where sharing cannot
hold (several ranks, an async mode, offloaded or differently typed parameters, another engine or
placement), nothing is shared.

Real components: the tiny model, the actor on one gloo rank, a real HFEngine replica in a RolloutHost.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from verl_agent.engine.contract import SamplingParams
from verl_agent.trainer.weights.shared_weights import actor_tensors, engine_shares_weights

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17], [20, 21], [30, 31, 32, 33, 34]]


def _greedy_log_probs(host, policy) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-prob of the greedy first token of each of PROMPTS: from the engine, and from the actor's
    forward on the same tokens."""
    from verl_agent.trainer.policy.actor import forward_log_probs
    from verl_agent.trainer.policy.batch import TrainSeq

    greedy = SamplingParams(temperature=0.0, max_new_tokens=1)

    async def generate_all() -> list:
        return await asyncio.gather(*(host.engine.generate(p, greedy) for p in PROMPTS))

    outs = host.run(generate_all())
    seqs = [TrainSeq(input_ids=p + o.token_ids, prompt_len=len(p), loss_mask=torch.ones(1))
            for p, o in zip(PROMPTS, outs)]
    with torch.no_grad():
        actor, _ = forward_log_probs(policy.actor, seqs, 1.0, policy.device)
    return torch.tensor([o.logprobs[0] for o in outs]), torch.cat(actor)


@pytest.mark.parametrize("sleeps", [False, True], ids=["awake", "free_cache_engine"])
def test_engine_reads_the_actors_parameters_on_one_rank(sleeps, make_cfg, tiny_model_path, one_rank, random_seqs):
    """The engine's parameters are the actor's tensors, before and after an update and its sync; the sync
    sends 0 bytes, still counts the version and drops the idle sessions' KV, and the engine's log-probs
    are the updated actor's. An engine that sleeps for the update (and is asked to drop its weights) keeps
    them shared and generates after its wake."""
    from verl_agent.trainer.policy import memory
    from verl_agent.trainer.policy.policy import Policy
    from verl_agent.trainer.weights.weight_transport import WeightSender
    from verl_agent.trainer.workers.rollout_worker import RolloutHost

    cfg = make_cfg("trainer.num_cpu_workers=1", "actor_rollout_ref.actor.optim.lr=1e-2",
                   f"actor_rollout_ref.rollout.free_cache_engine={str(sleeps).lower()}")
    assert engine_shares_weights(cfg, "cpu", 1)
    device = torch.device("cpu")
    policy = Policy(cfg, 0, device, one_rank, str(tiny_model_path))
    assert memory._inputs(cfg, policy.actor, device, [policy.actor]).engine_bytes == 0  # no weights of its own
    actor = actor_tensors(policy.actor, frozen_only=False)
    host = RolloutHost(cfg, 0, str(tiny_model_path), device, shards=1, kv_cache_bytes=policy.memory.kv_cache_bytes,
                       shared_weights=actor)
    engine = dict(host.engine.model.named_parameters())

    def shared() -> bool:
        return engine.keys() == actor.keys() and all(engine[n].data_ptr() == t.data_ptr() for n, t in actor.items())

    step = host.engine._batcher.runner.decode_step
    assert len(step.tensors(step.layers[0])[1]) == 1  # the actor's q/k/v lie back to back: one product

    try:
        assert shared()
        before, actor_before = _greedy_log_probs(host, policy)
        assert torch.allclose(before, actor_before, atol=1e-5)
        host.run(host.engine.generate(PROMPTS[0], SamplingParams(max_new_tokens=2, seed=0), session="s"))
        assert host.engine.metrics()["engine/sessions_idle"] == 1
        if sleeps:
            host.sleep()  # as the sync loop does: RolloutHost asks a full fine-tune's engine to drop its weights
            assert shared()
        seqs = random_seqs(6, 300)
        for s in seqs:
            s.advantages = torch.linspace(-1, 1, s.response_len)
        policy.update(seqs, n_minibatches=1, step=1)
        sender = WeightSender(0, device)
        assert sender.to_local_engine(host, policy.engine_weights(), drain=True, version=1, previous=0) == 1
        assert sender.sent_bytes == 0 and host.engine.policy_version == 1 and shared()
        assert host.engine.metrics()["engine/sessions_idle"] == 0  # computed by the old weights
        after, actor_after = _greedy_log_probs(host, policy)
        assert torch.allclose(after, actor_after, atol=1e-5)
        assert (after - before).abs().max() > 1e-3  # the update reached the engine
    finally:
        host.close()


_GPU_BF16 = ["trainer.n_gpus_per_node=1", "actor_rollout_ref.model.dtype=bfloat16"]


@pytest.mark.parametrize(("overrides", "device_type", "world"), [
    ([], "cpu", 2),
    (["trainer.mode=one_step_off"], "cpu", 1),
    (["trainer.mode=async"], "cpu", 1),
    ([*_GPU_BF16, "actor_rollout_ref.actor.fsdp_config.param_offload=true"], "cuda", 1),
    (["trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.dtype=bfloat16"], "cuda", 1),  # fp32 master weights
    (["actor_rollout_ref.rollout.dtype=bfloat16"], "cpu", 1),
    (["actor_rollout_ref.rollout.name=sglang"], "cpu", 1),
    (["trainer.placement=split", "trainer.rollout_workers=1"], "cpu", 1),
], ids=["two-ranks", "one-step-off", "async", "param-offload", "gpu-fp32-actor-bf16-engine", "cpu-dtypes-differ",
        "sglang", "split"])
def test_nothing_is_shared_where_it_cannot_hold(overrides, device_type, world, make_cfg):
    cfg = make_cfg("trainer.num_cpu_workers=1", *overrides)
    assert not engine_shares_weights(cfg, device_type, world)


@pytest.mark.parametrize(("overrides", "device_type"), [
    ([], "cpu"),
    (_GPU_BF16, "cuda"),
    (["trainer.n_gpus_per_node=1"], "cuda"),  # an fp32 engine reads the fp32 master weights
], ids=["cpu", "gpu-bf16", "gpu-fp32"])
def test_shared_where_the_actor_holds_the_engines_dtype(overrides, device_type, make_cfg):
    assert engine_shares_weights(make_cfg("trainer.num_cpu_workers=1", *overrides), device_type, 1)


@pytest.mark.slow
def test_a_one_rank_sync_run_moves_no_bytes_and_samples_the_updated_policy(ray_cluster, make_cfg):
    """The trainer's own wiring (TrainWorker.setup, the loop's sleep, update and sync): every sync of a
    one-rank run moves 0 bytes, and each step's engine log-probs are the actor's before that step's update
    (an engine a step behind differs by the last update's change)."""
    from verl_agent.trainer.loop import train

    # the entropy bonus moves the policy even where every reward is equal (zero advantages)
    result = train(make_cfg("trainer.num_cpu_workers=1", "trainer.total_training_steps=3", "data.val_files=[]",
                            "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2", "data.max_response_length=32",
                            "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.optim.lr=1e-2",
                            "actor_rollout_ref.actor.entropy_coeff=0.1",
                            "actor_rollout_ref.actor.old_log_prob_source=actor"))  # for the log-prob comparison
    hist = result.history
    assert [h["perf/weight_sync_bytes"] for h in hist] == [0.0] * 3
    assert all(h["engine/generated_tokens"] > 0 for h in hist)
    assert max(h["rollout/actor_logprob_diff_max"] for h in hist) < 1e-4
