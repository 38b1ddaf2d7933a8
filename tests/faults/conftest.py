"""tests/faults: prints the table of faults, outcomes and recovery times the module measured (see test_faults.py).

detect s: from the fault to the run's error; recover s: from the rerun's start to its first completed
step (worker start-up, checkpoint load, one step), or for the sandbox from its restart to its first answer.
"""

from __future__ import annotations

from fault_helpers import REPORT


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if not REPORT:
        return
    tr = terminalreporter
    tr.section("fault injection (tests/faults)")
    tr.write_line(f"{'fault':<52} {'outcome':<44} {'resume exact':<12} {'detect s':>8} {'recover s':>9}")
    for r in REPORT:
        tr.write_line(f"{r['fault']:<52} {r['outcome']:<44} {r['exact']:<12} {r['detect']:>8} {r['resume']:>9}")
