"""Every script in scripts/ still starts: each Python script prints its --help (so its imports
of qvl_trt resolve after a rename), each shell script parses (`bash -n`); and the few facts of
a script that a cheap run can check (no server started)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from qvl_trt.deploy import monitoring as m
from qvl_trt.deploy.kubernetes import DEFAULT_NAME

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


# ---- scripts/verify_gpu.sh: which tests a run with no arguments selects ---------------------

VERIFY_GPU = REPO / "scripts" / "verify_gpu.sh"
TIER_MARKERS = ("gpu", "trt", "trtllm", "torchvision")
# Records each collected test's file and markers before and after `-m` deselects.
MARKER_PROBE = '''
import pytest

@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items):
    for item in items:
        marks = ",".join(sorted({m.name for m in item.iter_markers()}))
        print("ALL", item.nodeid.split("::")[0], marks)

def pytest_collection_finish(session):
    for item in session.items:
        print("SELECTED", item.nodeid.split("::")[0])
'''


def verify_gpu_default() -> tuple[str, list[str]]:
    """The marker expression and the pytest arguments that scripts/verify_gpu.sh passes when
    run with no arguments, read from the script."""
    text = VERIFY_GPU.read_text()
    (tiers,) = re.findall(r'^TIERS="([^"]+)"$', text, re.M)
    (default,) = re.findall(r'^if \[ "\$#" -eq 0 \]; then\n\s+set -- ([^\n]+)\nfi$', text, re.M)
    assert '-m "$TIERS"' in text, "verify_gpu.sh no longer selects by TIERS"
    return tiers, shlex.split(default)


def test_verify_gpu_selects_every_test_file_with_a_tier_marker(tmp_path):
    tiers, default = verify_gpu_default()
    (tmp_path / "marker_probe.py").write_text(MARKER_PROBE)
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "-p", "marker_probe", "-m", tiers, *default], cwd=REPO,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])},
        capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    marked, selected = set(), set()
    for line in result.stdout.splitlines():
        kind, _, rest = line.partition(" ")
        if kind == "ALL":
            path, _, marks = rest.partition(" ")
            if set(marks.split(",")) & set(TIER_MARKERS):
                marked.add(path)
        elif kind == "SELECTED":
            selected.add(rest)
    # The files' own text, as a check that the probe saw the markers at all.
    pattern = re.compile(r"mark\.(" + "|".join(TIER_MARKERS) + r")\b|trtllm_gpu_marks\(")
    in_source = {f"tests/{p.name}" for p in (REPO / "tests").glob("test_*.py")
                 if pattern.search(p.read_text())}
    assert in_source and in_source <= marked, sorted(in_source - marked)
    assert marked == selected, (f"marked, not selected: {sorted(marked - selected)}; "
                                f"selected, not marked: {sorted(selected - marked)}")


# ---- scripts/render_dashboard.py: Prometheus scrapes the pod as the PodMonitor would ---------

def test_render_dashboards_scrape_config_passes_promtool_and_meets_every_pod_selector(tmp_path):
    """The configuration the picture's Prometheus runs with (printed, nothing started) passes
    `promtool check config`, scrapes each page the PodMonitor names at its path, and gives its
    targets labels that every dashboard query's pod-side selector matches (the DCGM exporter's
    come from outside the pod)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("needs promtool: apt-get install prometheus (make prometheus, "
                    "run by `make test` as root)")
    printed = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "render_dashboard.py"), "--print-config"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
        timeout=60, check=False)
    assert printed.returncode == 0, printed.stderr
    config = tmp_path / "prometheus.yml"
    config.write_text(printed.stdout)
    checked = subprocess.run([promtool, "check", "config", str(config)], capture_output=True,
                             text=True, timeout=60, check=False)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    jobs = json.loads(printed.stdout)["scrape_configs"]
    endpoints = m.manifests(DEFAULT_NAME, {"labels": {}}, {})["podmonitor.yaml"]["spec"][
        "podMetricsEndpoints"]
    assert [j["metrics_path"] for j in jobs] == [e.get("path", "/metrics") for e in endpoints]
    for job in jobs:
        labels = {r["target_label"]: r["replacement"] for r in job["relabel_configs"]}
        for panel in m.dashboard(DEFAULT_NAME)["panels"]:
            for target in panel["targets"]:
                expr = m.grafana_expanded(target["expr"], labels["namespace"])
                for metric, matchers in m.selectors(expr):
                    if m.SOURCES[metric] is m.Source.DCGM:
                        continue
                    for label, op, value in matchers:
                        if label in labels:
                            assert op in ("=", "=~") and re.fullmatch(value, labels[label]), \
                                (job["job_name"], expr, label)
