"""The one protocol for a build step run in a child process (the vision engine, each LLM
engine rank), so a crash or an out-of-memory kill becomes a clean BuildError and memory is
returned when it ends.

The child (`child_main`) logs "LEVEL name: message" lines to stderr and ends, on a user
error, with the message alone on its last line, exiting with StageUnavailable.exit_code when
this machine lacks what the step needs (the build can be resumed elsewhere) and 1 otherwise.
The parent (`run_child`) keeps the whole output in a log file, relays warnings, and raises
with the log tail, the log's path and the reproduce.sh (`write_reproduce`) that reruns it.

A child never outlives its parent: it runs in its own process group with PR_SET_PDEATHSIG
(SIGKILL when the parent dies, even by SIGKILL), and a parent leaving `run_child` by an
exception (Ctrl-C, SIGTERM turned into one, an error) kills the group and reaps it first, so
nothing writes into a staging folder after the build that owned it has ended.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from .atomic import write_json_atomic
from .errors import BuildError, DependencyError, QvlError, StageUnavailable
from .typed_config import to_jsonable

log = logging.getLogger(__name__)

UNAVAILABLE_EXIT = StageUnavailable.exit_code
_TAIL_LINES = 12
_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG")
REPRODUCE_NAME = "reproduce.sh"


def write_reproduce(path: Path, commands: Sequence[str], comment: str, *,
                    in_folder: bool = True) -> Path:
    """Write an executable bash script at `path` that runs `commands` (shell lines) after
    `comment`; `in_folder`: from the script's folder, which the commands' relative paths
    name."""
    path = Path(path)
    path.write_text("\n".join([
        "#!/usr/bin/env bash",
        *(f"# {line}".rstrip() for line in comment.splitlines()),
        "set -euo pipefail",
        *(['cd "$(dirname "$0")"'] if in_folder else []),
        *commands,
    ]) + "\n")
    path.chmod(0o755)
    return path


def run_module_child(folder: Path, module: str, config: Any, *, config_name: str,
                     log_name: str, reproduce_name: str, what: str, comment: str) -> None:
    """Write `config` (a dataclass) as `folder/config_name` and a reproduce script that runs
    `python -m module config_name` in `folder`, then run that command as a child (`run_child`,
    its output in `folder/log_name`)."""
    folder = Path(folder)
    write_json_atomic(folder / config_name, to_jsonable(config))
    script = write_reproduce(
        folder / reproduce_name, [f'"${{PYTHON:-python3}}" -m {module} {config_name}'],
        f"{comment}\nPYTHON picks the interpreter.")
    run_child([sys.executable, "-m", module, config_name], cwd=folder,
              log_path=folder / log_name, what=what, reproduce=script)


def run_child(cmd: Sequence[str], *, cwd: Path | None, log_path: Path, what: str,
              reproduce: Path) -> None:
    """Run `cmd`; its output goes to `log_path`. Raises StageUnavailable (the child's exit
    code StageUnavailable.exit_code) with the child's reason, or BuildError naming `what`,
    the reason (or the log tail after a crash), the log and `reproduce`."""
    tail: deque[str] = deque(maxlen=_TAIL_LINES)
    proc = None
    with Path(log_path).open("w", encoding="utf-8") as log_file:
        try:
            with signals_held():
                proc = popen_owned(cmd, cwd=cwd, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, errors="replace")
            assert proc.stdout is not None
            for line in proc.stdout:
                log_file.write(line)
                if line.strip():
                    tail.append(_relay(line.rstrip()))
            code = proc.wait()
        except BaseException:
            if proc is not None:
                kill_group(proc.pid)
                proc.wait()
            raise
    if code == UNAVAILABLE_EXIT:
        raise StageUnavailable(tail[-1] if tail else f"{what} is unavailable here")
    if code != 0:
        # A child that failed cleanly printed its reason last; after a crash, show the tail.
        why = (f"killed by signal {-code}" + (" (out of memory?)" if -code == 9 else "")
               if code < 0 else f"exit code {code}")
        detail = tail[-1] if code == 1 and tail else " | ".join(tail) or "no output"
        raise BuildError(f"{what} failed ({why}): {detail}. Full log: {log_path}; reproduce "
                         f"with: bash {shlex.quote(str(reproduce))}")


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent: int) -> None:
    """A preexec_fn body (in the forked child, before exec): have the kernel SIGKILL the child
    when the thread that started it ends, however it ends (kill -9 included). Linux only;
    elsewhere the process-group kill is what remains. The parent may have died between fork
    and prctl: then the child is already orphaned and leaves at once."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            os._exit(126)
    if os.getppid() != parent:
        os._exit(126)


@contextlib.contextmanager
def signals_held(signums: Sequence[int] = (signal.SIGINT, signal.SIGTERM)) -> Iterator[None]:
    """Hold SIGINT and SIGTERM for the block, then deliver them to their handlers: around
    starting a child and keeping its handle. A handler that raises (Ctrl-C's KeyboardInterrupt,
    serve's stop before ready) could otherwise fire between fork and the assignment, e.g. in
    Popen waiting for exec, and the child would run on with no one to stop it. Handlers run in
    the main thread only, so elsewhere there is nothing to hold."""
    if threading.current_thread() is not threading.main_thread() or \
            any(signal.getsignal(s) is None for s in signums):  # None: not set from Python
        yield
        return
    caught: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: caught.append(signum))
                for s in signums}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for s in dict.fromkeys(caught):
            signal.raise_signal(s)


def popen_owned(cmd: Sequence[str], **popen: Any) -> subprocess.Popen:
    """Start `cmd` as a child that never outlives this process: its own process group (so
    kill_group ends it and whatever it starts, and a terminal's Ctrl-C reaches only us) and
    SIGKILL when the starting thread ends (die_with_parent). Call it inside signals_held()
    and keep the handle there."""
    return subprocess.Popen(list(cmd), start_new_session=True,
                            preexec_fn=functools.partial(die_with_parent, os.getpid()), **popen)


def kill_group(pgid: int) -> None:
    """SIGKILL a process group (a child and anything it started)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _relay(line: str) -> str:
    """Log a child's line: its warnings and errors at their level, the rest at debug.
    Returns the line without its level and logger name."""
    level, _, rest = line.partition(" ")
    if level not in _LEVELS:
        log.debug("%s", line)  # native code or a library printing directly, or a traceback
        return line
    _, sep, message = rest.partition(": ")
    message = message if sep else rest
    number = logging.getLevelName(level)
    log.log(number if number >= logging.WARNING else logging.DEBUG, "%s", message)
    return message


def child_main(fn: Callable[[list[str]], None], argv: list[str] | None = None) -> int:
    """Run `fn(argv)` as a child's entry point; returns its exit code (0 when done)."""
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root.handlers[:] = [handler]
    try:
        fn(sys.argv[1:] if argv is None else argv)
    except QvlError as exc:
        sys.stdout.flush()
        print(exc, file=sys.stderr, flush=True)
        return UNAVAILABLE_EXIT if isinstance(exc, (StageUnavailable, DependencyError)) else 1
    return 0
