"""The child-process protocol both engine builds use (qvl_trt/child.py), with real children."""

from __future__ import annotations

import subprocess
import sys
import textwrap

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
