"""``python -m verl_agent.containers.janitor STATE_DIR OWNER_PID``: the bwrap runtime's clean-up after its owner.

Started by each ``BwrapRuntime`` with a pipe as stdin whose write end only the owner holds. It blocks on
that pipe; when it reads end-of-file the owner has exited, however (a SIGKILL included), and it removes
the owner's containers: tmpfs mounts, directories, control groups (their shells already died with
their parent).
"""

from __future__ import annotations

import sys
from pathlib import Path


def main() -> None:
    state_dir = Path(sys.argv[1])
    while sys.stdin.buffer.read(4096):
        pass
    from verl_agent.containers.bwrap import reap_state

    reap_state(state_dir)


if __name__ == "__main__":
    main()
