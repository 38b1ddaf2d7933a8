"""Fixtures for tests/tasks: the Harbor-layout task (task_helpers.make_task) and one container pool per module."""

from __future__ import annotations

from pathlib import Path

import pytest
from task_helpers import make_task


@pytest.fixture(scope="session")
def count_task(tmp_path_factory) -> Path:
    return make_task(tmp_path_factory.mktemp("tasks"))


@pytest.fixture(scope="module")
def pool():
    from verl_agent.tasks.pool import ContainerPool

    p = ContainerPool(warm=0, max_starting=4)
    yield p
    p.close_sync()
