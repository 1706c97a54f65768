"""`qvl-trt deploy --monitoring`'s dashboard and alerts (qvl_trt/deploy/monitoring.py), checked
by promtool (Debian's prometheus, make prometheus): every query of the dashboard
and every alert parses, the rule file passes `promtool check rules`, and `promtool test rules`
fires the KV-cache-full and error-rate alerts on synthetic series (and not below their
thresholds). The dashboard's JSON model holds together as Grafana reads it. That every series
they use is published by a served deployment is checked where one runs
(test_gateway_app.py, test_serve_supervisor.py) with `missing_series` below."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from qvl_trt.deploy import monitoring as m

NAME = "qwen"
NAMESPACE = "inference"
DOCS = Path(__file__).resolve().parents[1] / "docs" / "deployment.md"
# Labels the scrape adds (the PodMonitor's job, the pod's namespace and name, the target),
# which a metrics page does not carry.
SCRAPE_LABELS = {"job", "namespace", "pod", "instance", "container", "endpoint"}


def promtool() -> str:
    tool = shutil.which("promtool")
    if tool is None:
        pytest.skip("needs promtool: apt-get install prometheus (make prometheus, "
                    "run by `make test` as root)")
    return tool


def run_promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=60)


def write_rules(path: Path, rules: list[dict]) -> Path:
    path.write_text(json.dumps({"groups": [{"name": "qvl", "rules": rules}]}))  # YAML 1.2
    return path


def test_every_query_parses_and_the_rule_file_passes_promtool(tmp_path) -> None:
    rules = write_rules(tmp_path / "alerts.yaml", m.alert_rules(NAME))
    done = run_promtool("check", "rules", str(rules))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(m.alert_rules(NAME))} rules found" in done.stdout
    # The dashboard's queries as Grafana sends them, each as a recording rule's expression.
    queries = [{"record": f"q:{i}", "expr": m.grafana_expanded(expr, NAMESPACE)}
               for i, expr in enumerate(m.expressions(NAME))]
    done = run_promtool("check", "rules", str(write_rules(tmp_path / "queries.yaml", queries)))
    assert done.returncode == 0, done.stdout + done.stderr
    # A query broken on purpose is refused.
    broken = [{"record": "q:broken", "expr": queries[0]["expr"].replace("sum by", "sum bye")}]
    done = run_promtool("check", "rules", str(write_rules(tmp_path / "broken.yaml", broken)))
    assert done.returncode != 0 and "parse error" in done.stdout + done.stderr


def alert_test(interval: str, series: dict[str, str], at: str,
               alerts: dict[str, list[dict]]) -> dict:
    return {"interval": interval,
            "input_series": [{"series": s, "values": v} for s, v in series.items()],
            "alert_rule_test": [{"eval_time": at, "alertname": name, "exp_alerts": exp}
                                for name, exp in alerts.items()]}


def test_the_kv_cache_and_error_rate_alerts_fire_on_synthetic_series(tmp_path) -> None:
    rules = write_rules(tmp_path / "alerts.yaml", m.alert_rules(NAME))
    scope = f'job="{m.job(NAME, NAMESPACE)}", namespace="{NAMESPACE}", pod="{NAME}-1"'
    kv = (f'nv_trt_llm_kv_cache_block_metrics{{{scope}, model="tensorrt_llm", '
          'kv_cache_block_type="fraction", version="1"}')
    ok, failed = (f'qvl_gateway_requests_total{{{scope}, model="m", build="b", stream="true", '
                  f'status="{s}"}}' for s in (200, 500))
    labels = lambda **kw: {"severity": kw.pop("severity"), **kw}  # noqa: E731
    kv_fired = labels(severity="warning", namespace=NAMESPACE, pod=f"{NAME}-1",
                      model="tensorrt_llm")
    annotations = {r["alert"]: r["annotations"] for r in m.alert_rules(NAME)}

    def fired(alert: str, summary: str, **labels: str) -> list[dict]:
        return [{"exp_labels": labels, "exp_annotations": {**annotations[alert],
                                                           "summary": summary}}]

    tests = [
        # Full for 10 minutes: fires once the 5 minutes of `for` have passed.
        alert_test("1m", {kv: "0.99x20"}, "10m", {"QvlTrtKvCacheFull": fired(
            "QvlTrtKvCacheFull", f"the KV cache of tensorrt_llm in {NAME}-1 is 99% full",
            **kv_fired)}),
        alert_test("1m", {kv: "0.99x20"}, "4m", {"QvlTrtKvCacheFull": []}),
        alert_test("1m", {kv: "0.9x20"}, "10m", {"QvlTrtKvCacheFull": []}),
        # 10 of 100 requests a minute fail: 10% > 5%; 2 of 100: no alert.
        alert_test("1m", {ok: "0+90x30", failed: "0+10x30"}, "20m", {"QvlTrtErrorRate": fired(
            "QvlTrtErrorRate", "10% of requests fail with 5xx",
            **labels(severity="critical", namespace=NAMESPACE))}),
        alert_test("1m", {ok: "0+98x30", failed: "0+2x30"}, "20m", {"QvlTrtErrorRate": []}),
    ]
    spec = tmp_path / "alerts.test.yaml"
    spec.write_text(json.dumps({"rule_files": [str(rules)], "evaluation_interval": "1m",
                                "tests": tests}))
    done = run_promtool("test", "rules", str(spec))
    assert done.returncode == 0, done.stdout + done.stderr
    # The test can fail: a threshold moved past what the series show breaks it.
    raised = [dict(r, expr=r["expr"].replace("> 0.95", "> 0.995")) for r in m.alert_rules(NAME)]
    write_rules(rules, raised)
    done = run_promtool("test", "rules", str(spec))
    assert done.returncode != 0 and "QvlTrtKvCacheFull" in done.stdout + done.stderr


def test_each_alert_has_a_for_a_severity_annotations_and_a_runbook_entry() -> None:
    docs = DOCS.read_text()
    for rule in m.alert_rules(NAME):
        assert re.fullmatch(r"\d+m", rule["for"]), rule
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert {"summary", "description", "runbook"} <= set(rule["annotations"])
        assert f"`{rule['alert']}`" in docs, f"no runbook line for {rule['alert']} in {DOCS}"


def test_the_dashboard_model_holds_together() -> None:
    board = m.dashboard(NAME)
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = board["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells = set()
    for panel in panels:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"] and panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(set(refs)) == len(refs)
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24
        area = {(x, y) for x in range(g["x"], g["x"] + g["w"])
                for y in range(g["y"], g["y"] + g["h"])}
        assert not area & cells, f"{panel['title']} overlaps another panel"
        cells |= area
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"]
            # every variable a query uses is the dashboard's or Grafana's own
            used = set(re.findall(r"\$(\w+)", target["expr"]))
            assert used <= set(variables) | {"__rate_interval"}, used
    titles = " ".join(p["title"] for p in panels)
    for wanted in ("Requests", "Errors", "Time to first token", "Inter-token", "Queue length",
                   "Queue wait", "Batch slots", "KV cache", "Cache hit", "Tokens/s", "GPU "
                   "utilisation", "GPU memory"):
        assert wanted in titles
    # every selector names a series whose publisher is known
    for expr in m.expressions(NAME):
        for metric, _ in m.selectors(expr):
            assert metric in m.SOURCES, metric


def missing_series(samples, sources: set[m.Source]) -> list[str]:
    """The selectors of the dashboard and alerts, among those published by `sources`, that no
    sample of `samples` (serve.progress.parse_metrics) matches: its name, its exact label
    matchers, and the labels its regular expressions match (a status=~"5.." series appears
    with the first server error: the label must exist, not yet that value); labels the scrape
    adds apart."""
    missing = []
    for expr in m.expressions(NAME):
        for metric, matchers in m.selectors(expr):
            if m.SOURCES[metric] not in sources:
                continue
            wanted = [(k, op, v) for k, op, v in matchers if k not in SCRAPE_LABELS]
            if not any(name == metric and all(_matches(dict(labels).get(k, ""), op, v)
                                              for k, op, v in wanted)
                       for name, labels in samples):
                missing.append(f"{metric}{{{', '.join(f'{k}{op}{v!r}' for k, op, v in wanted)}}}")
    return sorted(set(missing))


def _matches(value: str, op: str, pattern: str) -> bool:
    """`value` ("" where the label is absent) against one matcher, as missing_series reads it."""
    return value == pattern if op == "=" else value != pattern if op == "!=" else value != ""


def report_missing(missing: list[str]) -> None:
    """Fail naming the missing series."""
    assert missing == []


def test_missing_series_names_what_a_page_lacks() -> None:
    """The served checks' helper, on a page with one series: it finds the label matcher the
    series fails, and the series absent."""
    from qvl_trt.serve.progress import parse_metrics

    page = parse_metrics('nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="used",'
                         'model="tensorrt_llm",version="1"} 3\n')
    missing = missing_series(page, {m.Source.TRITON})
    assert "nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type='fraction'}" in missing
    assert "qvl_vision_cache_hits_total{}" in missing
    assert not [s for s in missing if "DCGM" in s or "gateway" in s]
