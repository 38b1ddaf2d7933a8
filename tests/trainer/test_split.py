"""trainer.placement=split end to end (real Ray, gloo, FSDP2, tiny model): the engines run in their own
RolloutWorker actors. One rollout worker feeding one train rank is the colocated run step for step, also
across a resume from a checkpoint; with
2 train ranks and 1 rollout worker the groups reach the ranks through the object store, async training
trains every sample exactly once, and a weight sync leaves every engine with the actor's weights by each
route: a gloo broadcast, shared memory, the object store; a rollout worker that dies fails the push by name.
"""

from __future__ import annotations

import json
import time

import pytest
import ray
import torch

from verl_agent.trainer.workers.controller import WorkerGroup
from verl_agent.trainer.workers.sharding import shard_list
from worker_probes import set_sequences, weights_digests
from verl_agent.trainer.loop import train

pytestmark = pytest.mark.slow

FAST = ["data.val_files=[]", "data.max_response_length=48"]


def _trained_uids(run) -> list[str]:
    return [json.loads(line)["uid"] for path in sorted((run / "trajectories").glob("step_*.jsonl"))
            for line in path.open()]


def test_one_rollout_worker_for_one_train_rank_is_the_colocated_run_and_resumes_exactly(ray_cluster, make_cfg,
                                                                                         tmp_path):
    base = [*FAST, "trainer.num_cpu_workers=1", "trainer.save_freq=1"]
    colocated = train(make_cfg(*base, "trainer.total_training_steps=3", run_dir=tmp_path / "colocated"))
    split = [*base, "trainer.placement=split"]
    first = train(make_cfg(*split, "trainer.total_training_steps=2", run_dir=tmp_path / "split"))
    resumed = train(make_cfg(*split, "trainer.total_training_steps=3", run_dir=tmp_path / "split"))
    assert resumed.resumed_from == 2  # the rollout worker got the checkpoint's weights from the train rank
    for a, b in zip(colocated.history, first.history + resumed.history, strict=True):
        assert a["rollout/reward/mean"] == b["rollout/reward/mean"]
        assert a["rollout/model_tokens_total"] == b["rollout/model_tokens_total"]  # the same samples
        assert a["actor/pg_loss"] == pytest.approx(b["actor/pg_loss"], rel=1e-4, abs=1e-6)
    assert _trained_uids(tmp_path / "colocated") == _trained_uids(tmp_path / "split")


def test_async_split_trains_every_sample_once_and_validates(ray_cluster, make_cfg, tmp_path):
    run = tmp_path / "run"
    result = train(make_cfg("data.max_response_length=48", "trainer.placement=split", "trainer.mode=async",
                            "trainer.max_staleness=1", "trainer.total_training_steps=3", run_dir=run))
    assert result.val_after["val/num_trajectories"] == 32  # held-out rollouts ran on the rollout worker
    assert len((run / "trajectories" / "val_step_3.jsonl").read_text().splitlines()) == 32
    assert [m["rollout/num_trajectories"] for m in result.history] == [16.0] * 3  # 4 prompts x n=4 per step
    assert all(m["rollout/policy_lag/max"] <= 1 for m in result.history)
    uids = _trained_uids(run)
    assert len(uids) == 3 * 16 and set(uids.count(u) for u in set(uids)) == {4}  # 12 prompts, 4 samples each


def test_sync_gives_every_rollout_worker_the_actors_weights(ray_cluster, make_cfg, random_seqs):
    from verl_agent.rollout.build import sampling_params

    cfg = make_cfg("trainer.placement=split", "trainer.rollout_workers=2", "trainer.num_cpu_workers=1",
                   "actor_rollout_ref.actor.optim.lr=1e-2", "trainer.weight_transport=collective")
    group = WorkerGroup.create(cfg)
    try:
        actor, *engines = weights_digests(group)
        assert engines == [pytest.approx(actor, rel=1e-9)] * 2  # both loaded the same model
        assert group.routes == ["collective", "collective"]  # both joined rank 0's gloo WeightGroup
        seqs = random_seqs(8, 300)
        # a broadcast to both; then shared memory (the default on one host) and the object store side by side
        for step, routes in [(1, ["collective", "collective"]), (2, ["handle", "object_store"])]:
            group.routes = routes
            for s in seqs:
                s.advantages = torch.randn(s.response_len)
            set_sequences(group, shard_list(seqs, group.world_size))
            group.compute_log_probs(n_minibatches=1)
            group.update(n_minibatches=1, step=step, update_actor=True)
            actor, *engines = weights_digests(group)
            assert all(abs(e - actor) > 1e-3 * actor for e in engines)  # the update moved the actor away
            group.sync_weights(version=step)
            actor, *engines = weights_digests(group)
            assert engines == [pytest.approx(actor, rel=1e-9)] * 2
        # the groups of both rollout workers reach the one train rank, through the object store
        from verl_agent.rollout.build import train_dataset

        samples = list(next(iter(train_dataset(cfg.data).batches(4))))
        counts = group.feed(samples, 2, sampling_params(cfg.actor_rollout_ref.rollout, cfg.data, seed=3), batch=1)
        assert counts == [2, 2]
        results = group.take(counts, step=1, min_version=2)
        assert [len(r.summaries) for r in results] == [4, 4] and [len(r.taken) for r in results] == [2, 2]
        assert all(s.oldest_version == 2 for r in results for s in r.summaries)
        group.compute_log_probs(n_minibatches=1)
        assert group.compute_advantages(0.0).sequences == 8  # the train rank holds all 8 trajectories
        # a receiver that dies fails the push naming the rollout worker, within seconds (gloo sees the reset
        # connection too; NCCL would wait for its timeout, which is why rank 0 watches the receiving calls)
        ray.kill(group.rollouts[1])
        t0 = time.monotonic()
        with pytest.raises(ray.exceptions.RayError, match="RolloutWorker"):
            ray.get(group.workers[0]._push_weights.remote(9, group.rollouts, ["collective", "collective"]))
        assert time.monotonic() - t0 < 30
    finally:
        group.shutdown()
