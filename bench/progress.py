"""Progress lines for long benchmarks (stderr, so the table and the JSON line on stdout stay clean).

`Progress` counts units of work (generated tokens, steps) against a known total and prints, at most every
`every` seconds and from a heartbeat when nothing finished meanwhile (a graph capture, a compile):
what is done, the rate so far and the time left at that rate.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from typing import TextIO

__all__ = ["Progress", "eta"]


def eta(done: float, total: float, elapsed: float) -> float | None:
    """Seconds left at the rate so far; None before anything is done."""
    if done <= 0 or elapsed <= 0:
        return None
    return max(0.0, (total - done) * elapsed / done)


class Progress:
    def __init__(self, label: str, total: float, unit: str = "tok", every: float = 10.0, out: TextIO | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:  # fmt: skip
        self.label, self.total, self.unit, self.every = label, float(total), unit, every
        self.out, self.clock = out or sys.stderr, clock
        self.done, self.phase = 0.0, ""
        self.start = self.last = clock()
        self._beat: asyncio.Task | None = None

    def line(self) -> str:
        elapsed = self.clock() - self.start
        left = eta(self.done, self.total, elapsed)
        rate = f", {self.done / elapsed:,.0f} {self.unit}/s" if self.done and elapsed > 0 else ""
        tail = f", ~{left:,.0f} s left" if left is not None else ""
        phase = f" ({self.phase})" if self.phase else ""
        return (f"# {self.label}{phase}: {self.done:,.0f}/{self.total:,.0f} {self.unit} "
                f"({100 * self.done / max(self.total, 1):.0f}%) in {elapsed:,.0f} s{rate}{tail}")

    def add(self, n: float) -> None:
        self.done += n
        if self.clock() - self.last >= self.every:
            self.show()

    def show(self) -> None:
        self.last = self.clock()
        print(self.line(), file=self.out, flush=True)

    async def heartbeat(self) -> None:
        """Print a line every `every` s even when no unit finished (start it as a task; cancel at the end)."""
        while True:
            await asyncio.sleep(self.every)
            if self.clock() - self.last >= self.every:
                self.show()

    def __enter__(self) -> Progress:
        try:
            self._beat = asyncio.get_running_loop().create_task(self.heartbeat())
        except RuntimeError:  # no event loop: lines come from `add` only
            self._beat = None
        return self

    def __exit__(self, *exc: object) -> None:
        if self._beat is not None:
            self._beat.cancel()
        self.show()
