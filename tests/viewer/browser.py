"""Serving a run on a free port and driving Debian's chromium with Playwright (no browser download).

The browser is found at $VERL_AGENT_CHROMIUM, else `chromium` on PATH (scripts/setup_chromium.sh,
run by `make test`, installs it). A missing browser FAILS the tests: they are the viewer's only
check that the page really renders.
"""

from __future__ import annotations

import os
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import uvicorn

from verl_agent.viewer import Run, create_app

ARTIFACTS = Path(os.environ.get("VERL_AGENT_TEST_ARTIFACTS", Path(__file__).parents[2] / "test-artifacts")) / "viewer"


def chromium_path() -> str:
    path = os.environ.get("VERL_AGENT_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not path:
        pytest.fail("no chromium found: run `bash scripts/setup_chromium.sh` (make test does) "
                    "or set VERL_AGENT_CHROMIUM to a Chromium binary", pytrace=False)  # fmt: skip
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving(run_path: Path) -> Iterator[str]:
    """The viewer of `run_path` served by a real uvicorn in a thread; yields its URL."""
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(Run(run_path)), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        server.should_exit = True
        thread.join(10)
