"""Checkpoints: never half-written, always resumable.

Layout under ``<run dir>/checkpoints``::

    global_step_4/                  a complete checkpoint (renamed into place last)
        actor/  critic/             torch.distributed.checkpoint (DCP) shards: model + optimizer
        extra_rank{r}.pt            per-rank LR scheduler and RNG states
        driver_state.json           step, data position, driver RNG, metrics history length
    global_step_8.tmp/              being written (or left by a crash): ignored, cleaned on the next save
    latest_checkpointed_iteration.txt   the newest complete step (verl's file name), replaced atomically

A checkpoint directory is written as ``.tmp`` by all ranks, then the driver
renames it (an atomic rename on one filesystem) and updates the "latest" file.
A crash at any point leaves the previous checkpoint and "latest" intact.
Multi-node runs need the run directory on storage every node can write.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch

__all__ = ["CKPT_DIR", "LATEST", "tmp_dir", "finalize", "latest_checkpoint", "driver_state", "restore_driver_rng",
           "save_shards", "load_shards"]

CKPT_DIR = "checkpoints"
LATEST = "latest_checkpointed_iteration.txt"


def tmp_dir(run_dir: Path, step: int) -> Path:
    root = run_dir / CKPT_DIR
    for stale in root.glob("*.tmp"):  # left by an interrupted save
        shutil.rmtree(stale, ignore_errors=True)
    path = root / f"global_step_{step}.tmp"
    path.mkdir(parents=True)
    return path


def finalize(tmp: Path, state: dict[str, Any]) -> Path:
    """Write the driver state, rename the tmp dir into place, then point "latest" at it."""
    (tmp / "driver_state.json").write_text(json.dumps(state))
    final = tmp.with_name(tmp.name[: -len(".tmp")])
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    latest = final.parent / LATEST
    part = latest.with_suffix(".part")
    part.write_text(str(state["step"]))
    os.replace(part, latest)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint, or None."""
    root = run_dir / CKPT_DIR
    latest = root / LATEST
    if latest.is_file():
        path = root / f"global_step_{latest.read_text().strip()}"
        if (path / "driver_state.json").is_file():
            return path
    done = [p for p in root.glob("global_step_*")
            if not p.name.endswith(".tmp") and (p / "driver_state.json").is_file()]
    return max(done, key=lambda p: int(p.name.rsplit("_", 1)[1]), default=None)


def driver_state(step: int, data_state: dict, extra: dict | None = None) -> dict[str, Any]:
    """What the driver needs to continue: step, data position and its own RNG (for shuffles/seeds)."""
    py = random.getstate()
    return {"step": step, "data": data_state, "python_rng": [py[0], list(py[1]), py[2]],
            "torch_rng": torch.get_rng_state().tolist(), **(extra or {})}


def restore_driver_rng(state: dict[str, Any]) -> None:
    py = state["python_rng"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    torch.set_rng_state(torch.tensor(state["torch_rng"], dtype=torch.uint8))


def save_shards(path: Path, name: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Collective: every rank writes its shard of model + optimizer state (DCP)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path / name))


def load_shards(path: Path, name: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Collective: load this rank's shard in place (resharding to another world size is handled by DCP)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path / name))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
