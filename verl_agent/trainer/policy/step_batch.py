"""`StepBatch`: one train rank's trajectories of the current step, as training sequences, and their records.

The groups a rank keeps for a step become `TrainSeq`s (`prepare.train_seqs`: the failure rules leave
out what must not reach the loss). With trainer.log_trajectories, each trajectory is written once:
those that cannot reach the loss when the step's groups arrive (a stopped step still shows its
failures), the rest with their per-token advantages once `Policy.compute_advantages` has them.
The trained records are written on a thread of their own while the update runs (`log_trained`; the worker
waits for them when its update returns); `flush` waits, and a write that failed raises there. The others
are on disk when `log` returns: a run stopped by a failure rule kills its workers without waiting.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from verl_agent.protocol import Trajectory
from verl_agent.rollout.stream import Group
from verl_agent.trainer.algorithms.advantage_base import needs_groups
from verl_agent.trainer.policy.batch import TrainSeq
from verl_agent.trainer.policy.prepare import train_seqs
from verl_agent.trainer.workers.rollout_worker import log_trajectories

if TYPE_CHECKING:
    from verl_agent.config import RunConfig

__all__ = ["StepBatch"]


class StepBatch:
    """This rank's trajectories (`trajs`) and training sequences (`seqs`) of step `step`."""

    def __init__(self, cfg: RunConfig, tokenizer: Any) -> None:
        self.cfg, self.tokenizer = cfg, tokenizer
        self.trajs: list[Trajectory] = []
        self.seqs: list[TrainSeq] = []  # the trajectories that may be trained on, as training sequences
        self.step = 0
        self.pending: list[int] = []  # positions in trajs whose records wait for their advantages
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trajectory-records")
        self._writes: list[Future] = []

    def keep(self, groups: list[Group], step: int) -> dict[str, float]:
        """Hold `groups` for step `step`; returns what the failure rules left out, counted by cause."""
        self.flush()
        self.trajs = [t for g in groups for t in g.trajectories]
        self.seqs, counts = train_seqs(self.trajs, needs_groups(self.cfg.algorithm.adv_estimator))
        self.step = step
        self.pending = sorted(s.extra["trajectory"] for s in self.seqs)
        waiting = set(self.pending)
        self.log([t for i, t in enumerate(self.trajs) if i not in waiting], f"step_{step}.jsonl", step)
        return counts

    def log_trained(self) -> None:
        """Write the records that waited for their advantages (those of `seqs` carry them)."""
        self.log(self.trajs, f"step_{self.step}.jsonl", self.step, self.seqs, only=self.pending, background=True)
        self.pending = []

    def log(self, trajs: list[Trajectory], name: str, step: int, seqs: list[TrainSeq] | None = None,
            only: list[int] | None = None, background: bool = False) -> None:  # fmt: skip
        """trainer.log_trajectories for these trajectories (see rollout_worker.log_trajectories).

        With `seqs`, each trajectory that reached the loss carries its per-token advantages;
        `only`: the positions in `trajs` to write; `background`: return before they are written (`flush`).
        """
        if not self.cfg.trainer.log_trajectories or not trajs or (only is not None and not only):
            return
        advs: list = [None] * len(trajs)
        for s in seqs or []:
            if "trajectory" in s.extra and s.advantages is not None:
                advs[s.extra["trajectory"]] = s.advantages.tolist()
        keep = range(len(trajs)) if only is None else only
        self._writes.append(self._writer.submit(log_trajectories, self.cfg, self.tokenizer, [trajs[i] for i in keep],
                                                name, step, [advs[i] for i in keep]))
        if not background:
            self.flush()

    def flush(self) -> None:
        """Wait until every record handed to `log` is written; a write that failed raises here."""
        writes, self._writes = self._writes, []
        for write in writes:
            write.result()
