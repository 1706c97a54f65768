"""How long a repository takes to start: serve measures each start, from launching
tritonserver until its models are loaded and warmed up (serve/warmup.py), and keeps the
slowest in LOAD_RECORD at the repository's root (Triton reads only its folders). The startup
window that a pod's startup probe (`qvl-trt deploy`) and a baked image's health check
(`qvl-trt image --bake-repo`) give a start is sized from it (`startup_window_s`). A
repository serve cannot write to (a read-only volume, a baked image) keeps what it had: the
record is made where the repository is first served, e.g. `docker run` of the serving image
on a GPU machine with the repository mounted, before baking or deploying.
"""

from __future__ import annotations

import json
import logging
import socket
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from ..atomic import write_json_atomic
from .liveness import LivenessRules
from .server import STARTUP_TIMEOUT_S
from .supervisor import START_ATTEMPTS

log = logging.getLogger(__name__)

LOAD_RECORD = "serve_load_time.json"
# Without a measured start, the window must not cut one that serve is still making: serve
# tries START_ATTEMPTS starts of up to STARTUP_TIMEOUT_S each (the engines load meanwhile),
# then /ready turns 200 once the first end-to-end probe answers (an idle server answers it at
# once; one that does not within the stall timeout is restarted, serve/liveness.py). When
# serve gives up it exits, and the kubelet restarts the pod.
STARTUP_WINDOW_S = START_ATTEMPTS * (STARTUP_TIMEOUT_S + LivenessRules.stall_timeout_s)
# With one, STARTUP_MARGIN times the slowest, at least STARTUP_FLOOR_S: a node new to the
# repository reads its engines from a cold disk or a network volume where the measuring
# machine may have had them in its page cache, and a start that fails early is tried again
# within the window. A pod that does not start within it is restarted by the kubelet, as
# serve would restart it.
STARTUP_MARGIN = 3.0
STARTUP_FLOOR_S = 60.0


@dataclass(frozen=True)
class LoadTime:
    slowest_s: float  # the slowest start measured
    starts: int  # how many starts were measured
    host: str  # where the slowest was measured
    measured: str  # when (UTC, ISO 8601)


def read_load_time(repo: Path) -> LoadTime | None:
    """The repository's record, None where serve never wrote one (or it is unreadable)."""
    try:
        return LoadTime(**json.loads((Path(repo) / LOAD_RECORD).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def record_load_time(repo: Path, seconds: float) -> LoadTime | None:
    """Add one measured start to the record; None where the repository is not writable."""
    old = read_load_time(repo)
    slowest = old is None or seconds > old.slowest_s
    new = LoadTime(
        round(seconds, 1) if slowest else old.slowest_s, (old.starts if old else 0) + 1,
        socket.gethostname() if slowest else old.host,
        datetime.now(timezone.utc).isoformat(timespec="seconds") if slowest else old.measured)
    path = Path(repo) / LOAD_RECORD
    try:
        write_json_atomic(path, asdict(new))
    except OSError as exc:
        log.info("started in %.1f s; the load-time record %s is not writable (%s)", seconds,
                 path, exc)
        return None
    return new


def startup_window_s(load: LoadTime | None) -> float:
    """How long a start of a repository with the record `load` may take before it is given up."""
    return STARTUP_WINDOW_S if load is None else max(STARTUP_FLOOR_S,
                                                     STARTUP_MARGIN * load.slowest_s)
