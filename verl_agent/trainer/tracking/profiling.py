"""`RankProfiler`: trainer.profile_steps on one train rank (torch.profiler, CUDA kernels included)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

__all__ = ["RankProfiler"]


class RankProfiler:
    """Profiles everything a rank does between `start` and `stop`; `stop` writes the top ops and a Chrome trace."""

    def __init__(self, rank: int, device: torch.device) -> None:
        self.rank, self.device = rank, device
        self._profiler: Any = None

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
        self._profiler = profile(activities=activities)
        self._profiler.__enter__()

    def stop(self, out_dir: str, step: int) -> str:
        """Write the top ops (by self device time on GPU, self CPU time on CPU) and the Chrome trace; the
        table's path."""
        if self._profiler is None:
            raise RuntimeError("stop_profile without start_profile")
        prof, self._profiler = self._profiler, None
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        prof.__exit__(None, None, None)
        out = Path(out_dir) / f"step_{step}_rank{self.rank}"
        out.parent.mkdir(parents=True, exist_ok=True)
        key = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        out.with_suffix(".txt").write_text(prof.key_averages().table(sort_by=key, row_limit=40))
        prof.export_chrome_trace(str(out.with_suffix(".json.gz")))
        return str(out.with_suffix(".txt"))
