"""The child-process protocol both engine builds use (qvl_trt/child.py), with real children."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from qvl_trt.child import UNAVAILABLE_EXIT, child_main, run_child, write_reproduce
from qvl_trt.errors import (
    BuildError,
    CheckpointError,
    ConfigError,
    DependencyError,
    StageUnavailable,
)


def _run(tmp_path, code: str, what: str = "the step"):
    reproduce = write_reproduce(tmp_path / "reproduce.sh", ["true"], "Rerun the step.")
    run_child([sys.executable, "-c", code], cwd=tmp_path, log_path=tmp_path / "step.log",
              what=what, reproduce=reproduce)


def test_exit_code_is_stage_unavailables():
    assert UNAVAILABLE_EXIT == StageUnavailable.exit_code == 3


def test_exit_3_is_stage_unavailable_with_the_childs_reason(tmp_path):
    with pytest.raises(StageUnavailable, match="^no GPU here$"):
        _run(tmp_path, "print('INFO x: starting'); print('no GPU here'); exit(3)")


def test_failure_names_the_reason_the_log_and_the_reproduce_script(tmp_path):
    with pytest.raises(BuildError) as info:
        _run(tmp_path, "print('WARNING x: first'); print('second'); exit(2)", "rank 1 build")
    assert not isinstance(info.value, StageUnavailable)
    assert str(info.value) == (
        f"rank 1 build failed (exit code 2): first | second. Full log: {tmp_path / 'step.log'}"
        f"; reproduce with: bash {tmp_path / 'reproduce.sh'}")
    assert (tmp_path / "step.log").read_text() == "WARNING x: first\nsecond\n"


def test_a_clean_failure_shows_its_last_line_and_a_crash_its_signal(tmp_path):
    with pytest.raises(BuildError, match=r"failed \(exit code 1\): the reason\. Full log"):
        _run(tmp_path, "print('noise'); print('the reason'); exit(1)")
    with pytest.raises(BuildError, match=r"killed by signal 9 \(out of memory\?\)\): noise\. Full"):
        _run(tmp_path, "import os, signal; print('noise', flush=True); "
                       "os.kill(os.getpid(), signal.SIGKILL)")


def test_success_raises_nothing_and_keeps_the_log(tmp_path):
    _run(tmp_path, "print('done')")
    assert (tmp_path / "step.log").read_text() == "done\n"


@pytest.mark.parametrize(("error", "code"), [
    (None, 0),
    (StageUnavailable, 3),
    (DependencyError, 3),
    (BuildError, 1),
    (ConfigError, 1),
    (CheckpointError, 1),
])
def test_child_main_maps_each_error_to_its_exit_code(tmp_path, error, code):
    raising = f"raise errors.{error.__name__}('the reason')" if error else "pass"
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(f"""
        import logging, sys
        from qvl_trt import errors
        from qvl_trt.child import child_main

        def step(argv):
            assert argv == ["a", "b"]
            logging.getLogger("step").info("working")
            {raising}

        sys.exit(child_main(step))
    """))
    done = subprocess.run([sys.executable, str(script), "a", "b"], capture_output=True,
                          text=True)
    assert done.returncode == code, done.stderr
    lines = done.stderr.splitlines()
    assert lines[0] == "INFO step: working"
    assert lines[-1] == ("the reason" if error else "INFO step: working")


def test_child_main_lets_a_bug_keep_its_traceback():
    with pytest.raises(KeyError):
        child_main(lambda argv: {}["missing"], [])


def test_child_main_and_run_child_together(tmp_path):
    """What the engines do: the parent turns the child's StageUnavailable back into one."""
    script = tmp_path / "child.py"
    script.write_text("import sys\nfrom qvl_trt import errors\nfrom qvl_trt.child import "
                      "child_main\n\ndef step(argv):\n    raise errors.DependencyError("
                      "'tensorrt_llm is missing')\n\nsys.exit(child_main(step))\n")
    reproduce = write_reproduce(tmp_path / "reproduce.sh", [f"{sys.executable} child.py"], "x")
    with pytest.raises(StageUnavailable, match="^tensorrt_llm is missing$"):
        run_child([sys.executable, str(script)], cwd=tmp_path, log_path=tmp_path / "l.log",
                  what="step", reproduce=reproduce)
    rerun = subprocess.run(["bash", str(reproduce)], cwd="/", capture_output=True, text=True)
    assert rerun.returncode == UNAVAILABLE_EXIT and "tensorrt_llm is missing" in rerun.stderr


def test_reproduce_script_is_strict_bash_run_from_its_folder(tmp_path):
    script = write_reproduce(tmp_path / "r.sh", ["pwd", "false", "echo after"], "one\ntwo")
    text = script.read_text()
    assert text.startswith("#!/usr/bin/env bash\n# one\n# two\nset -euo pipefail\n")
    done = subprocess.run(["bash", str(script)], cwd="/", capture_output=True, text=True)
    assert done.returncode == 1 and done.stdout == f"{tmp_path}\n"  # stops at `false`
    here = write_reproduce(tmp_path / "h.sh", ["pwd"], "x", in_folder=False)
    assert subprocess.run([str(here)], cwd="/", capture_output=True,
                          text=True).stdout == "/\n"


# ---- a child never outlives its parent ---------------------------------------------------

# The child: its pid, then a tick appended every 20 ms, forever.
_TICKER = ("import os, sys, time\n"
           "open('pid', 'w').write(str(os.getpid()))\n"
           "while True:\n"
           "    open('ticks', 'a').write('.')\n"
           "    time.sleep(0.02)\n")
# The parent: run_child (or, to show the check can fail, a plain Popen) of the ticker.
# SIGINT's handler is set as an interactive Python has it: a shell's background job (`cmd &`
# without job control, e.g. a CI step) starts with SIGINT ignored, and that is inherited.
_PARENT = ("import signal, subprocess, sys\n"
           "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
           "from pathlib import Path\n"
           "from qvl_trt.child import run_child\n"
           "d = Path(sys.argv[2]); cmd = [sys.executable, '-c', sys.argv[3]]\n"
           "if sys.argv[1] == 'plain':\n"
           "    subprocess.Popen(cmd, cwd=d).wait()\n"
           "run_child(cmd, cwd=d, log_path=d / 'log', what='ticker', reproduce=d / 'r.sh')\n")


def _alive(pid: int) -> bool:
    """Running (a zombie nobody reaped yet counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_until(predicate, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def start_ticker(tmp_path: Path, how: str) -> tuple[subprocess.Popen, int]:
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, how, str(tmp_path), _TICKER])
    assert wait_until(lambda: (tmp_path / "ticks").exists(), 60), "the child never started"
    return parent, int((tmp_path / "pid").read_text())


def assert_gone_and_quiet(pid: int, ticks: Path) -> None:
    """Gone within 5 s of its parent, and writing nothing after."""
    assert wait_until(lambda: not _alive(pid), 5), f"child {pid} outlived its parent"
    size = ticks.stat().st_size
    time.sleep(0.2)
    assert ticks.stat().st_size == size


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGINT, signal.SIGTERM])
def test_the_child_dies_with_its_parent(tmp_path, how):
    parent, pid = start_ticker(tmp_path, "run_child")
    parent.send_signal(how)  # SIGKILL: PR_SET_PDEATHSIG; SIGINT: the group kill on the way out
    parent.wait(timeout=30)
    assert_gone_and_quiet(pid, tmp_path / "ticks")


def test_without_run_child_the_child_survives(tmp_path):
    """The check above can fail: a plainly started child outlives a killed parent."""
    parent, pid = start_ticker(tmp_path, "plain")
    parent.kill()
    parent.wait(timeout=30)
    try:
        assert not wait_until(lambda: not _alive(pid), 1)
    finally:
        os.kill(pid, signal.SIGKILL)


def _stop_before_exec() -> None:
    """A preexec_fn: SIGTERM the parent while it waits in Popen for the exec. Sent earlier,
    while the parent still runs its after-fork hooks (logging's _releaseLock), the handler's
    exception would be swallowed as unraisable; so wait until the parent sleeps (its read of
    the exec pipe), seen in its /proc stat, a state field readable without ptrace rights."""
    parent = os.getppid()
    stat = Path(f"/proc/{parent}/stat")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if stat.read_text().rpartition(")")[2].split()[0] == "S":
            break
        time.sleep(0.001)
    os.kill(parent, signal.SIGTERM)


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _running(marker: str, wait_s: float = 30.0) -> list[int]:
    """The pids whose command line holds `marker`, once there is one (an orphaned child may
    not have reached its exec yet) or after `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        found = []
        for entry in Path("/proc").glob("[0-9]*"):
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def test_a_stop_signal_while_a_child_starts_waits_until_its_handle_is_kept():
    """serve turns SIGTERM into KeyboardInterrupt before it is ready. Arriving while Popen
    waits for the exec, it leaves Popen with the child running and no handle to stop it
    (shown below, unguarded); signals_held delivers it once the handle is kept."""
    from qvl_trt.child import signals_held

    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        for guarded in (True, False):
            marker = f"qvl-trt-held-{os.getpid()}-{guarded}"
            cmd = [sys.executable, "-c", f"import time; time.sleep(60)  # {marker}"]
            # Unguarded, the interrupt can still land in an after-fork hook and be swallowed
            # (rare: the parent waited for the GIL there); then try again.
            for _ in range(5):
                proc = None
                try:
                    if guarded:
                        with signals_held():
                            proc = subprocess.Popen(cmd, preexec_fn=_stop_before_exec)
                    else:
                        proc = subprocess.Popen(cmd, preexec_fn=_stop_before_exec)
                    interrupted = False
                except KeyboardInterrupt:
                    interrupted = True
                running = _running(marker)
                for pid in running:
                    os.kill(pid, signal.SIGKILL)
                if proc is not None:
                    proc.wait()
                if interrupted or guarded:
                    break
            assert interrupted
            if guarded:
                assert proc is not None and running == [proc.pid]
            else:
                assert proc is None and len(running) == 1, "the unguarded start kept a handle"
        assert signal.getsignal(signal.SIGTERM) is _raise_interrupt
    finally:
        signal.signal(signal.SIGTERM, previous)
