"""Every script in scripts/ still starts: each Python script prints its --help (so its imports
of qvl_trt resolve after a rename), each shell script parses (`bash -n`)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PYTHON_SCRIPTS = sorted((REPO / "scripts").glob("*.py"))
SHELL_SCRIPTS = sorted((REPO / "scripts").glob("*.sh"))


def test_there_are_scripts_to_check():
    assert len(PYTHON_SCRIPTS) >= 10 and len(SHELL_SCRIPTS) >= 2


@pytest.fixture(scope="module")
def helps() -> Iterator[dict[Path, Future]]:
    """Every Python script's `--help`, each in a fresh interpreter, one per core at a time,
    all started when the first test asks."""
    def run(script: Path) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(script), "--help"], cwd=REPO,
                              env={**os.environ, "PYTHONPATH": str(REPO)},
                              capture_output=True, text=True, timeout=60, check=False)

    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        yield {script: pool.submit(run, script) for script in PYTHON_SCRIPTS}


@pytest.mark.parametrize("script", PYTHON_SCRIPTS, ids=lambda p: p.name)
def test_python_script_prints_its_help(script, helps):
    result = helps[script].result()
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage:"), result.stdout


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: p.name)
def test_shell_script_parses(script):
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True,
                            check=False)
    assert result.returncode == 0, result.stderr


def test_a_shell_syntax_error_is_caught(tmp_path):
    broken = tmp_path / "broken.sh"
    broken.write_text("if true; then\n  echo never closed\n")
    assert subprocess.run(["bash", "-n", str(broken)], capture_output=True,
                          check=False).returncode != 0
