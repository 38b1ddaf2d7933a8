"""Worker-side preparation: failure rules, sharded advantages == whole-batch advantages, group filters, KL control.

Sharding is simulated in one process: `all_reduce` sums the shards' statistics exactly as
torch.distributed would (the real collective runs in the trainer tests).
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch.testing import assert_close

from verl_agent.config import AlgorithmConfig
from verl_agent.protocol import Trajectory
from verl_agent.trainer.algorithms import KLController, compute_advantages
from verl_agent.trainer.batch import TrainSeq, pad_field
from verl_agent.trainer.prepare import assign_advantages, filter_groups, train_seqs


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
