"""Shared fixtures: the embedded tiny model is built once per machine and cached."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    """Path of the embedded tiny model (built on first use, then cached; no downloads)."""
    from verl_agent.models.tiny import build_tiny

    return Path(build_tiny())
