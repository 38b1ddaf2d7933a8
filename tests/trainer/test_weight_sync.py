"""Hybrid engine: after an update + sync, the engine's log-probs equal the FSDP actor's on the same tokens;
between its sleep and the sync it refuses to generate (its weights were dropped, not kept).

Real Ray workers, real torch.distributed (gloo, 2 ranks), real FSDP2, real HFEngine replica.
"""

from __future__ import annotations

import pytest
import torch

from verl_agent.trainer.workers.controller import WorkerFailure, WorkerGroup
from verl_agent.trainer.workers.sharding import shard_list
from worker_probes import check_sync, set_sequences, weights_digests

pytestmark = pytest.mark.slow


def test_sync_makes_engine_match_actor(ray_cluster, make_cfg, dev_model_path, random_seqs):
    cfg = make_cfg(f"actor_rollout_ref.model.path={dev_model_path}", "actor_rollout_ref.actor.optim.lr=1e-2",
                   "actor_rollout_ref.rollout.temperature=1.0")
    group = WorkerGroup.create(cfg)
    try:
        vocab = 300
        prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17]]
        assert max(check_sync(group, prompts)) < 1e-4  # fresh: both hold the same initial weights
        seqs = random_seqs(8, vocab)
        for s in seqs:
            s.advantages = torch.randn(s.response_len)
        set_sequences(group, shard_list(seqs, group.world_size))
        before = weights_digests(group)[0]
        group.compute_log_probs(n_minibatches=1)  # the engine sleeps here, dropping its weights
        metrics = group.update(n_minibatches=1, step=1, update_actor=True)
        assert all(m["grad_norm"] > 0 for m in metrics)
        assert abs(weights_digests(group)[0] - before) > 1e-3 * before  # the update moved the actor
        with pytest.raises(WorkerFailure, match="discarded by sleep"):  # the engine has no weights to sample with
            check_sync(group, prompts)
        assert group.sync_weights(version=1) >= 0
        assert max(check_sync(group, prompts)) < 1e-4  # every parameter is back, equal to the updated actor's
    finally:
        group.shutdown()
