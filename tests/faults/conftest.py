"""tests/faults: prints the table of faults, outcomes and recovery times the module measured (see test_faults.py)."""

from __future__ import annotations

from fault_helpers import REPORT


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if not REPORT:
        return
    tr = terminalreporter
    tr.section("fault injection (tests/faults)")
    tr.write_line(f"{'fault':<52} {'outcome':<44} {'resume exact':<12} {'detect s':>8} {'resume s':>8}")
    for r in REPORT:
        tr.write_line(f"{r['fault']:<52} {r['outcome']:<44} {r['exact']:<12} {r['detect']:>8} {r['resume']:>8}")
