"""A persistent torch.compile cache for the decode step, so the first-step compile is paid once per machine.

torch packs what a compile produced (Inductor's FX-graph and autotuning caches, AOTAutograd's, the dynamic
shape profile) into one blob (`torch.compiler.save_cache_artifacts`) and loads such a blob into its local
caches (`load_cache_artifacts`); dynamo then still traces, but the lowering, code generation and kernel
builds come from the cache. The blob is kept under $VERL_AGENT_CACHE/compile (default
~/.cache/verl_agent/compile), one file per key: the model's configuration and dtype, the device kind, the
versions of torch, transformers and triton, and the engine's own traced source (model_runner.py,
kv_pool.py, fused_norms.py, decode_step.py). Anything else that changes the graphs simply misses in torch's own
content-hashed caches.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import logging
import os
import platform
import tempfile
from pathlib import Path
from typing import Any

import torch

from verl_agent.paths import cache_root

logger = logging.getLogger(__name__)

__all__ = ["CompileCache", "compile_key"]

_TRACED = ("model_runner.py", "kv_pool.py", "fused_norms.py", "decode_step.py")  # our code inside the compiled region


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def _compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def compile_key(config: Any, dtype: torch.dtype, device: torch.device) -> str:
    """Hex key of what the compiled decode step depends on (see the module docstring)."""
    cfg = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    for k in ("_name_or_path", "transformers_version", "_attn_implementation_autoset", "_commit_hash"):
        cfg.pop(k, None)
    if device.type == "cuda":
        where = f"{torch.cuda.get_device_name(device)} sm{''.join(map(str, torch.cuda.get_device_capability(device)))}"
    else:
        where = f"cpu {platform.machine()}"
    here = Path(__file__).parent
    parts = {"config": cfg, "dtype": str(dtype), "device": where, "torch": torch.__version__,
             "transformers": _version("transformers"), "triton": _version("triton"),
             "source": hashlib.sha256(b"".join((here / f).read_bytes() for f in _TRACED)).hexdigest()}  # fmt: skip
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


class CompileCache:
    """One key's blob: `load()` once before the first compile, `saved_if_compiled()` after each forward that
    may have compiled."""

    def __init__(self, key: str, root: Path | None = None) -> None:
        self.path = (root or cache_root()) / "compile" / f"{key}.bin"
        self.loaded = 0  # artifacts loaded from the file
        self.saves = 0
        self._graphs = _compiled_graphs()

    def load(self) -> int:
        """Load the blob into torch's caches; returns how many artifacts it held (0: none yet, or unreadable)."""
        try:
            blob = self.path.read_bytes()
        except FileNotFoundError:
            return 0
        try:
            info = torch.compiler.load_cache_artifacts(blob)
        except Exception as e:  # noqa: BLE001 - a torch upgrade can make an old blob unreadable: compile afresh
            logger.warning("compile cache %s not loaded (%s); compiling afresh", self.path, e)
            return 0
        self.loaded = sum(len(v) for v in info.artifacts.values()) if info is not None else 0
        logger.info("compile cache: %d artifacts loaded from %s", self.loaded, self.path)
        return self.loaded

    def saved_if_compiled(self) -> bool:
        """Save when dynamo compiled a graph since the last call (its graph counter moved)."""
        graphs = _compiled_graphs()
        if graphs == self._graphs:
            return False
        self._graphs = graphs
        self.save()
        return True

    def save(self) -> None:
        """Write every artifact this process compiled or loaded so far (atomically: readers see old or new)."""
        packed = torch.compiler.save_cache_artifacts()
        if packed is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name + ".")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(packed[0])
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self.saves += 1
