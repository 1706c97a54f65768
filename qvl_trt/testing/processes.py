"""Whether a process group has ended, for the tests that stop or kill servers and children."""

from __future__ import annotations

import time
from pathlib import Path

# How long a stopped or orphaned process may take to leave: the python backend's stubs notice
# their server's death by polling, and a loaded machine stretches that. A process that never
# leaves fails the check all the same.
GONE_WITHIN_S = 60.0


def group_alive(pgid: int) -> bool:
    """Whether a process of the group still runs. Zombies do not count: a process killed
    after its parent died waits for whoever reaps orphans here (in a container PID 1 may
    never do it), but it holds no port, memory or /dev/shm."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # it ended while we looked
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def group_gone_within(pgid: int, seconds: float = GONE_WITHIN_S) -> bool:
    """Whether the group has ended within `seconds` (a SIGKILLed process takes a moment to
    leave, longer on a loaded machine)."""
    deadline = time.monotonic() + seconds
    while group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not group_alive(pgid)
