"""Finding a sandbox's processes from the host, for tests that kill them."""

from __future__ import annotations

import os
import time


def host_pid(marker: str, timeout: float = 20.0) -> int:
    """The pid of the first process whose command line contains `marker` (waits up to `timeout` s for it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if marker.encode() in open(f"/proc/{pid}/cmdline", "rb").read():
                    return int(pid)
            except OSError:
                pass
        time.sleep(0.02)
    raise AssertionError(f"no process with {marker!r}")


def agent_of(pid: int) -> int:
    """The sandbox agent (``python3 -I -u -c <agent source> /tmp/sandbox ...``) above ``pid``."""
    while pid > 1:
        pid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
        if open(f"/proc/{pid}/cmdline", "rb").read().startswith(b"/usr/bin/python3\0-I\0-u\0-c\0"):
            return pid
    raise AssertionError("agent not found")
