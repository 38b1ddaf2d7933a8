"""bench/progress.py: the progress lines long benchmarks print to stderr (rate and time left at that rate)."""

from __future__ import annotations

import asyncio
import importlib.util
import io
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _progress():
    spec = importlib.util.spec_from_file_location("bench_progress", BENCH / "progress.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_progress_lines_give_the_rate_and_the_time_left_and_a_heartbeat_while_nothing_finishes():
    mod = _progress()
    now = [0.0]
    out = io.StringIO()
    bar = mod.Progress("continuous+kv", 1000, every=10.0, out=out, clock=lambda: now[0])
    assert bar.line() == "# continuous+kv: 0/1,000 tok (0%) in 0 s"  # nothing done: no rate, no estimate
    now[0] = 4.0
    bar.add(200)
    assert out.getvalue() == ""  # at most one line every 10 s
    now[0] = 10.0
    bar.add(50)  # 250 tokens in 10 s: 25 tok/s, 750 left -> 30 s
    assert out.getvalue() == "# continuous+kv: 250/1,000 tok (25%) in 10 s, 25 tok/s, ~30 s left\n"
    assert mod.eta(0, 10, 5.0) is None and mod.eta(5, 10, 5.0) == 5.0

    async def capturing():  # a phase where no token finishes still prints
        bar.phase = "capturing the decode graphs"
        with bar:
            now[0] = 25.0
            await asyncio.sleep(0.05)

    bar.every = 0.01
    asyncio.run(capturing())
    assert "# continuous+kv (capturing the decode graphs): 250/1,000 tok (25%) in 25 s" in out.getvalue()
