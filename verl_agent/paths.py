"""Where verl-agent keeps what it builds once and reuses: one root for every part's cache."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_root"]


def cache_root() -> Path:
    """$VERL_AGENT_CACHE, else ~/.cache/verl_agent: built models and warm starts, compiled decode steps
    (engine/runner/compile_cache.py) and the container image store (containers/images.py)."""
    return Path(os.environ.get("VERL_AGENT_CACHE") or Path.home() / ".cache" / "verl_agent")
