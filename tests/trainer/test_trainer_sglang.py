"""The trainer's hybrid engine on SGLang: each FSDP worker launches its own REAL SGLang 0.5.23 server.

Real Ray workers (gloo, 2 ranks), real FSDP2, real SGLang on CPU (its plain-torch path, with the
test-only kernel shims of tests/sglang_shims; see tests/sglang_cpu.py). After an update and a sync,
each server's log-probs equal its actor's on the tokens the server samples; then one GRPO step runs
end to end through SGLang rollouts. SGLang on CPU matches transformers to ~1e-4 (float32), hence the
looser tolerance than the HF engine's.
"""

from __future__ import annotations

import math

import pytest
import torch
from sglang_cpu import CPU_ARGS, CPU_ENV, sglang_python

from verl_agent.trainer.workers.controller import WorkerGroup
from verl_agent.trainer.workers.sharding import shard_list
from worker_probes import check_sync, set_sequences
from verl_agent.trainer.loop import train

pytestmark = [pytest.mark.sglang, pytest.mark.slow]


@pytest.fixture
def sglang_cfg(make_cfg, dev_model_path):
    def make(*overrides: str):
        cfg = make_cfg(f"actor_rollout_ref.model.path={dev_model_path}", "actor_rollout_ref.rollout.name=sglang",
                       f"actor_rollout_ref.rollout.sglang.python={sglang_python()}", *overrides)
        cfg.actor_rollout_ref.rollout.sglang.extra_args = list(CPU_ARGS)
        cfg.actor_rollout_ref.rollout.sglang.env = dict(CPU_ENV)
        return cfg

    return make


def test_sync_makes_each_sglang_server_match_its_actor(ray_cluster, sglang_cfg, random_seqs):
    group = WorkerGroup.create(sglang_cfg("actor_rollout_ref.actor.optim.lr=1e-2",
                                          "actor_rollout_ref.rollout.temperature=1.0"))
    try:
        prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17]]
        assert max(check_sync(group, prompts)) < 1e-3  # fresh: same initial weights
        seqs = random_seqs(8, 300)
        for s in seqs:
            s.advantages = torch.randn(s.response_len)
        set_sequences(group, shard_list(seqs, group.world_size))
        group.compute_log_probs(n_minibatches=1)  # the servers sleep here
        assert all(m["grad_norm"] > 0 for m in group.update(n_minibatches=1, step=1, update_actor=True))
        assert max(check_sync(group, prompts)) > 1e-2  # the update moved the actor away from the servers
        assert group.sync_weights(version=1) >= 0
        assert max(check_sync(group, prompts)) < 1e-3
    finally:
        group.shutdown()


def test_one_grpo_step_with_sglang_rollouts(ray_cluster, sglang_cfg):
    result = train(sglang_cfg("data.val_files=[]", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2",
                              "actor_rollout_ref.actor.ppo_mini_batch_size=2", "data.max_response_length=48",
                              "trainer.total_training_steps=1", "trainer.num_cpu_workers=1"))  # 2 ranks: above
    step = result.history[0]
    assert step["rollout/num_trajectories"] == 4 and step["rollout/infra_failed"] == 0.0
    assert math.isfinite(step["actor/pg_loss"]) and step["time/weight_sync_worker"] >= 0


def test_trainer_refuses_a_shared_server_url(ray_cluster, sglang_cfg):
    cfg = sglang_cfg("actor_rollout_ref.rollout.sglang.url=http://127.0.0.1:9")
    with pytest.raises(Exception, match="one SGLang server per worker"):
        WorkerGroup.create(cfg).shutdown()
