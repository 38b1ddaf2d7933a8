"""SGLangEngine's launch: a server that never becomes healthy is stopped and launched again (once by
default), then the error names the timeout. The "server" is a stand-in script that never answers: a hang
of real SGLang (seen once in CI: 0.5.23 on CPU stuck while loading the tiny model) cannot be provoked."""

from __future__ import annotations

import pytest

from verl_agent.engine.backends.sglang_engine import SGLangEngine, SGLangError


async def test_a_server_that_never_gets_healthy_is_relaunched_once(tmp_path):
    launches = tmp_path / "launches"
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\necho launched >> {launches}\nexec sleep 120\n")
    fake.chmod(0o755)
    engine = SGLangEngine(model_path=str(tmp_path), python=str(fake), startup_timeout=2.0)
    first = engine.process
    try:
        with pytest.raises(SGLangError, match="not healthy after 2.0 s"):
            await engine.start()
        assert launches.read_text().split() == ["launched", "launched"]
        assert first.poll() is not None and engine.process is not first  # the hung one was stopped
    finally:
        engine.shutdown()
