"""Step metrics: a JSONL file and TensorBoard scalars in the run dir, W&B / MLflow (`loggers.py`), and one
console line per step.

Console line (the figures a person watches): reward mean, success rate, KL,
entropy, response length, turns, and where the step's time went (rollout,
tools, reward, log-probs, update, weight sync). Tool and reward seconds are
summed over a rank's concurrent trajectories (max over ranks), so they overlap
the rollout time rather than add to it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from verl_agent.registry import LOGGERS

__all__ = ["Tracker", "timer", "console_line"]

logger = logging.getLogger(__name__)

# The Tracker writes these itself (loggers.py registers the external ones): registered as None, valid names.
LOGGERS.register("console", None)
LOGGERS.register("tensorboard", None)


@contextmanager
def timer(name: str, timings: dict[str, float]) -> Iterator[None]:
    """Add the seconds spent in the block to timings['time/<name>']."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        timings[f"time/{name}"] = timings.get(f"time/{name}", 0.0) + time.perf_counter() - t0


_CONSOLE = [("reward", "rollout/reward/mean", ".3f"), ("success", "rollout/success_rate", ".2f"),
            ("kl", "actor/kl", ".4f"), ("entropy", "actor/entropy", ".3f"),
            ("resp_len", "rollout/response_length/mean", ".1f"), ("turns", "rollout/num_turns/mean", ".2f")]
_TIMES = ["rollout", "tools", "reward", "log_probs", "update", "weight_sync", "step"]


def console_line(step: int, m: dict[str, float]) -> str:
    parts = [f"step {step}"] + [f"{label} {m[key]:{fmt}}" for label, key, fmt in _CONSOLE if key in m]
    if "val/success_rate" in m:
        parts.append(f"val_success {m['val/success_rate']:.2f}")
    times = " ".join(f"{k} {m[f'time/{k}']:.1f}s" for k in _TIMES if f"time/{k}" in m)
    return " | ".join(parts) + (f" | time: {times}" if times else "")


class Tracker:
    """Writes metrics to <run_dir>/metrics.jsonl (always), TensorBoard, W&B and MLflow (those named in loggers).

    `config` (the run config as a dict), `project` and `experiment` name the W&B / MLflow run
    (trainer.project_name, trainer.experiment_name); see `trainer.loggers`.
    """

    def __init__(self, run_dir: Path, loggers: list[str], append: bool = False, config: dict[str, Any] | None = None,
                 project: str = "verl_agent", experiment: str = "run") -> None:  # fmt: skip
        from verl_agent.trainer.tracking.loggers import open_loggers

        self.path = run_dir / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.console = "console" in loggers
        self.tb = None
        if "tensorboard" in loggers:
            from torch.utils.tensorboard import SummaryWriter

            self.tb_dir = run_dir / "tensorboard"
            self.tb = SummaryWriter(str(self.tb_dir))
        if not append and self.path.exists():
            self.path.unlink()
        self.external = open_loggers(loggers, run_dir, project, experiment, config, resume=append)
        self.destinations = {ext.key: ext.where for ext in self.external}  # for the end-of-run summary

    def truncate_after(self, step: int) -> None:
        """On resume: drop what was logged for steps after the checkpoint (they will be recomputed).

        A line cut short by a crash mid-write is dropped with a warning; the kept lines replace the file
        atomically. TensorBoard discards its events from those steps on (purge_step)."""
        if self.tb is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.tb.close()
            self.tb = SummaryWriter(str(self.tb_dir), purge_step=step + 1)
        if not self.path.exists():
            return
        keep = []
        for n, line in enumerate(self.path.read_text().splitlines(), 1):
            try:
                record = json.loads(line) if line else None
            except json.JSONDecodeError:
                logger.warning("%s:%d: dropping a line cut short (a crash while writing it): %.80r", self.path, n, line)
                continue
            if record is not None and record.get("step", 0) <= step:
                keep.append(line)
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(ln + "\n" for ln in keep))
        tmp.replace(self.path)

    def log(self, step: int, metrics: dict[str, Any], write=print) -> None:
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **clean}) + "\n")
        if self.tb is not None:
            for k, v in clean.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()
        for ext in self.external:
            _guarded(ext, "metrics", step, ext.log_metrics, step, clean)
        if self.console:
            write(console_line(step, clean))

    def log_trajectories(self, step: int, paths: list[Path]) -> None:
        """The step's trajectory JSONL files (those that exist) to W&B (a sampled table) and MLflow (artifacts)."""
        paths = [p for p in paths if p.exists()]
        for ext in self.external if paths else []:
            _guarded(ext, "trajectories", step, ext.log_trajectories, step, paths)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        for ext in self.external:
            _guarded(ext, "the end of the run", None, ext.close)
        self.external = []


def _guarded(ext: Any, what: str, step: int | None, fn: Any, *args: Any) -> None:
    """An experiment tracker's call; its failure is a warning (metrics.jsonl has the data), never the run's end."""
    try:
        fn(*args)
    except Exception as e:
        when = f" of step {step}" if step is not None else ""
        logger.warning("%s could not log %s%s (%s: %s); metrics.jsonl and the trajectory files have it", ext.key,
                       what, when, type(e).__name__, e)
