"""`Feeder`: hands the workers batch after batch of prompts ahead of training, as trainer.mode asks.

sync feeds batch k at step k; one_step_off also batch k+1 (it rolls out while k trains); async
keeps trainer.max_staleness batches ahead. Batch k always gets the seed of step k (`step_seed`), so
a window of 0 reproduces a synchronous run exactly. Samples fed but not yet trained go into each
checkpoint (`in_flight`); a resumed run feeds them first, so no sample is lost or trained twice.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from verl_agent.protocol import Sample
from verl_agent.trainer.workers.sharding import shard_sizes

if TYPE_CHECKING:
    from verl_agent.config import RunConfig
    from verl_agent.trainer.workers.controller import WorkerGroup
    from verl_agent.trainer.workers.rollout_worker import RolloutResult

__all__ = ["Feeder", "step_seed"]


def step_seed(seed: int, step: int) -> int:
    """Rollout seed of a step: a resumed run samples exactly what the uninterrupted run sampled."""
    return random.Random(f"{seed}:{step}").randrange(1 << 40)


class Feeder:
    """Feeds `group` from `samples` (batches of one sample) up to `total` steps, starting at batch `first`
    (after `replay`: the in-flight samples of the checkpoint resumed from), and tracks what is untrained."""

    def __init__(self, group: WorkerGroup, samples: Iterator[Any], cfg: RunConfig, total: int, first: int,
                 replay: list[dict] | None = None) -> None:  # fmt: skip
        self.group, self.samples, self.cfg, self.total = group, samples, cfg, total
        self.ahead = cfg.trainer.batches_ahead
        self.staleness = self.ahead  # how many versions older than the engine's a trained group may be
        self.counts: dict[int, list[int]] = {}  # batch -> prompts per shard (what `take` asks each shard for)
        self.untrained: dict[tuple[int, int], Sample] = {}  # (batch, index in batch) -> sample
        self.next = first
        self.replay = [Sample.from_dict(row) for row in replay or []]

    def fill(self, step: int) -> None:
        """Feed every batch that trainer.mode wants in flight while step `step` trains."""
        from verl_agent.rollout.build import sampling_params

        rollout_cfg, size = self.cfg.actor_rollout_ref.rollout, self.cfg.data.train_batch_size
        while self.next <= min(step + self.ahead, self.total):
            batch = [self.replay.pop(0) if self.replay else next(self.samples)[0] for _ in range(size)]
            sampling = sampling_params(rollout_cfg, self.cfg.data, seed=step_seed(self.cfg.trainer.seed, self.next))
            self.counts[self.next] = self.group.feed(batch, rollout_cfg.n, sampling, batch=self.next)
            assert self.counts[self.next] == shard_sizes(size, self.group.rollout_shards)
            self.untrained.update({(self.next, index): sample for index, sample in enumerate(batch)})
            self.next += 1

    def take(self, step: int, min_version: int) -> list[RolloutResult]:
        """The finished groups of step `step` (one result per shard); their samples count as trained."""
        counts = self.counts.pop(step)
        outs = self.group.take(counts, step, min_version)
        offsets = [sum(counts[:shard]) for shard in range(len(counts))]  # shard i holds the prompts from here
        for shard, out in enumerate(outs):
            for batch, position in out.taken:
                del self.untrained[(batch, offsets[shard] + position)]
        return outs

    def in_flight(self) -> list[dict]:
        """The samples fed but not trained yet, in feeding order (for the checkpoint)."""
        return [sample.to_dict() for _, sample in sorted(self.untrained.items(), key=lambda item: item[0])]
