"""Worker-side preparation: failure rules, sharded advantages == whole-batch advantages, group filters, KL control.

Sharding is simulated in one process: `all_reduce` sums the shards' statistics exactly as
torch.distributed would (the real collective runs in the trainer tests).
"""

from __future__ import annotations

import os
import socket
import threading
from datetime import timedelta

import pytest
import torch
from torch.testing import assert_close

from verl_agent.config import AlgorithmConfig
from verl_agent.protocol import Trajectory
from verl_agent.trainer.algorithms import ADV_ESTIMATORS, KLController, compute_advantages
from verl_agent.trainer.policy.batch import TrainSeq, pad_field
from verl_agent.trainer.policy.prepare import apply_rollout_correction, assign_advantages, filter_groups, train_seqs


def traj(uid: str, reward: float, outcome: str = "policy_failure", n_tokens: int = 3) -> Trajectory:
    return Trajectory(uid=uid, prompt_ids=[1, 2], response_ids=[5] * n_tokens, loss_mask=[1] * n_tokens,
                      rollout_logprobs=[-0.5] * n_tokens, reward=reward, outcome=outcome,  # type: ignore[arg-type]
                      cause="engine_error" if outcome == "infra_failure" else None)


def test_infra_failures_never_reach_the_loss_and_depleted_groups_are_dropped():
    trajs = [traj("a", 1.0, "ok"), traj("a", 0.0), traj("a", 0.0, "infra_failure"),  # a keeps 2 of 3
             traj("b", 1.0, "ok"), traj("b", 0.0, "infra_failure"),  # b keeps 1 of 2: dropped
             traj("c", 0.0, "filtered", n_tokens=0), traj("c", 0.0, "filtered", n_tokens=0),
             traj("d", 1.0, "ok")]  # d was a group of one by design (n=1): kept
    seqs, counts = train_seqs(trajs, group_estimator=True)
    assert [(s.uid, s.score) for s in seqs] == [("a", 1.0), ("a", 0.0), ("d", 1.0)]
    assert counts == {"train/excluded_trajectories": 4.0, "train/dropped_groups": 1.0, "train/sequences": 3.0}
    # token estimators have no groups to deplete: every usable trajectory stays
    seqs, counts = train_seqs(trajs, group_estimator=False)
    assert [s.uid for s in seqs] == ["a", "a", "b", "d"] and counts["train/dropped_groups"] == 0


def seq(uid: str, score: float, length: int) -> TrainSeq:
    return TrainSeq(input_ids=list(range(2 + length)), prompt_len=2, loss_mask=torch.ones(length), uid=uid,
                    score=score)


def two_shards() -> tuple[list[TrainSeq], list[TrainSeq]]:
    return [seq("a", 1.0, 3), seq("a", 0.0, 2), seq("b", 0.5, 4)], [seq("c", 2.0, 1), seq("c", -1.0, 5)]


@pytest.mark.parametrize("estimator", ["reinforce_plus_plus", "reinforce_plus_plus_baseline", "grpo"])
def test_sharded_advantages_equal_the_whole_batch(estimator):
    """Two workers whitening with an all-reduce get exactly the whole batch's advantages."""
    algo = AlgorithmConfig(adv_estimator=estimator, gamma=0.9)
    left, right = two_shards()
    whole = left + right
    mask = pad_field([s.loss_mask for s in whole])
    expected, _ = compute_advantages(estimator, response_mask=mask, scores=torch.tensor([s.score for s in whole]),
                                     group_index=[s.uid for s in whole], gamma=0.9)

    # Two "workers" in two threads; each all-reduce meets the other's and returns the sum (or max).
    barrier, slots = threading.Barrier(2), [None, None]

    def reducer(i):
        def reduce(t, op="sum"):
            slots[i] = t.clone()
            barrier.wait()
            out = slots[0] + slots[1] if op == "sum" else torch.maximum(slots[0], slots[1])
            barrier.wait()  # both have read before the next call overwrites
            return out
        return reduce

    workers = [threading.Thread(target=assign_advantages, args=(shard, algo, 0.0, reducer(i)))
               for i, shard in enumerate((left, right))]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=30)
    got = [s.advantages for s in left + right]
    for g, row, s in zip(got, expected, whole):
        assert_close(g, row[: s.response_len], rtol=1e-5, atol=1e-6)


def test_filter_groups_metrics():
    seqs = [seq("a", 1.0, 2), seq("a", 0.5, 2), seq("b", 0.0, 2), seq("b", 0.0, 2), seq("c", 0.2, 2)]
    kept, share = filter_groups(list(seqs), "score")
    assert [s.uid for s in kept] == ["a", "a", "c"] and share == pytest.approx(3 / 5)
    # acc: success is reward >= 1, so a = [success, failure] still differs
    kept, _ = filter_groups(list(seqs), "acc")
    assert [s.uid for s in kept] == ["a", "a", "c"]
    seqs[1].score = 1.5  # a = [success, success]: uniform in acc, not in score
    assert [s.uid for s in filter_groups(list(seqs), "acc")[0]] == ["c"]
    assert [s.uid for s in filter_groups(list(seqs), "score")[0]] == ["a", "a", "c"]
    for s, r in zip(seqs, [1.0, 1.0, 0.0, 0.3, 0.2]):  # after a KL penalty, b's final rewards differ
        s.extra["final_reward"] = r
    assert [s.uid for s in filter_groups(list(seqs), "seq_final_reward")[0]] == ["b", "b", "c"]
    with pytest.raises(ValueError, match="filter_groups.metric"):
        filter_groups(list(seqs), "bogus")


def test_kl_in_reward_and_adaptive_controller_by_hand():
    algo = AlgorithmConfig(use_kl_in_reward=True, kl_penalty="kl", adv_estimator="grpo")
    s1, s2 = seq("a", 1.0, 2), seq("a", 0.0, 2)
    s1.old_log_probs, s1.ref_log_probs = torch.tensor([-1.0, -1.0]), torch.tensor([-1.5, -1.0])  # kl 0.5, 0
    s2.old_log_probs, s2.ref_log_probs = torch.tensor([-1.0, -2.0]), torch.tensor([-1.0, -1.0])  # kl 0, -1
    metrics, kl = assign_advantages([s1, s2], algo, kl_coef=0.1)
    # per-sequence mean KL: 0.25 and -0.5 -> batch mean -0.125; token mean (0.5 + 0 + 0 - 1) / 4 = -0.125
    assert kl == pytest.approx(-0.125) and metrics["reward/kl_penalty"] == pytest.approx(-0.125)
    # final rewards: 1 - 0.1 * 0.5 = 0.95 and 0 - 0.1 * (-1) = 0.1
    assert [s1.extra["final_reward"], s2.extra["final_reward"]] == pytest.approx([0.95, 0.1])

    ctl = KLController("adaptive", kl_coef=0.2, target_kl=0.1, horizon=100)
    ctl.update(current_kl=0.15, n_sequences=10)  # error clip(0.15/0.1 - 1) = 0.2 (at the cap): 0.2 * (1 + 0.02)
    assert ctl.value == pytest.approx(0.204)
    ctl.update(current_kl=0.09, n_sequences=50)  # error -0.1: 0.204 * (1 - 0.05)
    assert ctl.value == pytest.approx(0.1938)
    fixed = KLController("fixed", kl_coef=0.2)
    fixed.update(current_kl=5.0, n_sequences=1000)
    assert fixed.value == 0.2
    restored = KLController("adaptive", kl_coef=1.0)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == ctl.value


# every registered estimator, and gae over turns: (adv_estimator, gae_timestep_unit)
ESTIMATOR_UNITS = [(e, "token") for e in sorted(ADV_ESTIMATORS)] + [("gae", "turn")]


def _prepared(seqs: list[TrainSeq]) -> list[TrainSeq]:
    """The fields the worker attaches before assign_advantages: old / ref log-probs, critic values, anchor keys."""
    for i, s in enumerate(seqs):
        s.old_log_probs = s.rollout_log_probs = torch.full((s.response_len,), -1.0)
        s.ref_log_probs = torch.full((s.response_len,), -1.0 - 0.1 * i)
        s.old_values = torch.linspace(0.0, 1.0, s.response_len)
        s.turns, s.turn_keys = [(0, s.response_len)], [f"k{i % 2}"]
    return seqs


def _worker_steps(seqs: list[TrainSeq], estimator: str, unit: str, reduce) -> dict[str, float]:
    """What TrainWorker.compute_advantages runs on its sequences (KL in the reward, rollout correction, DAPO)."""
    algo = AlgorithmConfig(adv_estimator=estimator, gae_timestep_unit=unit, gamma=0.9, use_kl_in_reward=True)
    metrics, _ = assign_advantages(seqs, algo, 0.1, reduce)
    metrics.update(apply_rollout_correction(seqs, "token", 2.0, reduce))
    return {**metrics, "kept": filter_groups(seqs, "score", reduce)[1]}


@pytest.mark.parametrize("estimator,unit", ESTIMATOR_UNITS)
def test_an_empty_rank_runs_the_same_collectives_as_a_full_one(estimator, unit):
    """For every estimator, a rank with no sequences issues the same all-reduces (count, shape, op, order)
    as one with sequences, so no rank is left waiting in a collective the other never joins."""
    def recorder(log):
        def reduce(t, op="sum"):
            log.append((tuple(t.shape), op))
            return t
        return reduce

    full, empty = [], []
    _worker_steps(_prepared([seq("a", 1.0, 3), seq("a", 0.0, 2), seq("b", 0.5, 4)]), estimator, unit, recorder(full))
    _worker_steps([], estimator, unit, recorder(empty))
    assert empty == full and len(full) >= 4


def _gloo_worker(rank: int, world: int, port: int, out) -> None:
    import torch.distributed as dist

    from verl_agent.trainer.policy.actor import reduce_op as _reduce

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=30))
    try:
        for estimator, unit in ESTIMATOR_UNITS:
            seqs = _prepared(list(two_shards()[0])) if rank == 0 else []  # rank 1 got no sequences this step
            metrics = _worker_steps(seqs, estimator, unit, _reduce)
            # a collective after the step still meets its partner: the ranks stayed in step
            check = float(_reduce(torch.tensor([float(rank + 1)], dtype=torch.float64))[0])
            out.put((rank, estimator, unit, metrics, [s.advantages.tolist() for s in seqs], check))
        dist.barrier()
    except Exception as e:  # noqa: BLE001  (reported to the test, which fails on it)
        out.put((rank, "error", repr(e)))
    finally:
        dist.destroy_process_group()
    os._exit(0)


def test_a_rank_with_no_sequences_keeps_the_others_collectives_in_step():
    """Two gloo ranks, rank 1 with no sequences: for every estimator both ranks finish, agree on the batch-wide
    metrics, and rank 0's advantages equal those of its sequences trained alone (the empty rank adds nothing)."""
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_gloo_worker, args=(2, port, out), nprocs=2, start_method="spawn")
    got = {}
    while not out.empty():
        r = out.get()
        assert r[1] != "error", r
        got[r[:3]] = r[3:]
    assert len(got) == 2 * len(ESTIMATOR_UNITS)
    for estimator, unit in ESTIMATOR_UNITS:
        (m0, adv0, check0), (m1, adv1, check1) = got[0, estimator, unit], got[1, estimator, unit]
        assert check0 == check1 == 3.0 and adv1 == []
        assert m0 == pytest.approx(m1)
        alone = _prepared(list(two_shards()[0]))
        assert m0 == pytest.approx(_worker_steps(alone, estimator, unit, lambda t, op="sum": t))
        for a, s in zip(adv0, alone):
            assert a == pytest.approx(s.advantages.tolist(), abs=1e-6), (estimator, unit)
