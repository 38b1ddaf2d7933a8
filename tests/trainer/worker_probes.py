"""Test probes run on the trainer's Ray workers through their generic `run(fn)` call.

They read what only a worker can see (the actor's full weights, an engine's weights and log-probs) or
hand a rank training sequences directly, so the production classes carry no test-only methods.
Functions of this module travel to the workers by value (cloudpickle), so the workers need not
import the tests folder.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from typing import Any

import ray.cloudpickle
import torch

from verl_agent.engine.contract import SamplingParams
from verl_agent.trainer.policy.actor import forward_log_probs
from verl_agent.trainer.policy.batch import TrainSeq

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

__all__ = ["check_sync", "set_sequences", "weights_digests"]


def _actor_digest(worker: Any) -> float:
    """Sum of |w| over the actor's full parameters as the engines receive them, in float64 (collective)."""
    total = 0.0
    for bucket in worker.policy.engine_weights():
        total += float(sum(t.detach().double().abs().sum() for _, t in bucket))
    return total


def _engine_digest(rollout_worker: Any) -> float:
    """Sum of |w| over a split rollout worker's engine parameters (`hf` engine), in float64."""
    return float(sum(p.detach().double().abs().sum() for p in rollout_worker.host.engine.model.parameters()))


def _max_log_prob_gap(worker: Any, prompts: list[list[int]], max_new_tokens: int) -> float:
    """Max |engine log-prob - actor log-prob| on tokens the rank's engine samples now (temperature 1)."""
    sp = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, seed=1234)
    host = worker.rollout
    host.run(host.engine.wake_up())

    async def generate_all() -> list:
        return await asyncio.gather(*(host.engine.generate(p, sp) for p in prompts))

    outs = host.run(generate_all())
    seqs = [TrainSeq(input_ids=p + o.token_ids, prompt_len=len(p), loss_mask=torch.ones(len(o.token_ids)))
            for p, o in zip(prompts, outs) if o.token_ids]
    actor = worker.policy.actor
    actor.eval()
    with torch.no_grad():
        logp, _ = forward_log_probs(actor, seqs, 1.0, worker.device)
    engine = [torch.tensor(o.logprobs) for o in outs if o.token_ids]
    return max(float((a.cpu() - b).abs().max()) for a, b in zip(logp, engine))


def _use_sequences(worker: Any, seqs: list[TrainSeq]) -> None:
    """Train on these sequences instead of rolled-out ones (no trajectories, no records)."""
    worker.batch.trajs, worker.batch.seqs, worker.batch.pending = [], list(seqs), []


def weights_digests(group: Any) -> list[float]:
    """Sum of |w| of the actor's weights (first), then of each split rollout worker's engine."""
    return [group.run(_actor_digest)[0]] + group.run_on_rollouts(_engine_digest)


def check_sync(group: Any, prompts: list[list[int]], max_new_tokens: int = 16) -> list[float]:
    """Per train rank: max |engine log-prob - actor log-prob| on tokens its engine samples (colocated)."""
    return group.run(_max_log_prob_gap, prompts, max_new_tokens)


def set_sequences(group: Any, shards: Sequence[Sequence[TrainSeq]]) -> None:
    """Hand rank i the training sequences shards[i]."""
    assert len(shards) == group.world_size, (len(shards), group.world_size)
    group.run(_use_sequences, shards=[list(s) for s in shards])
