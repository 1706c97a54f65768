"""Monitoring for `qvl-trt deploy --monitoring`: a Grafana dashboard, a PodMonitor and a
PrometheusRule for the Prometheus Operator, over the series a pod publishes.

A pod publishes three metrics pages, all scraped by the PodMonitor: Triton's (port `metrics`:
Triton's own nv_inference_*, the stock tensorrt_llm backend's nv_trt_llm_*, the python models'
qvl_llm_* and qvl_vision_*), the gateway's (port `openai`, /metrics: qvl_gateway_*) and
serve's (port `health`, /metrics: qvl_serve_*). GPU utilisation and memory come from NVIDIA's
DCGM exporter, which runs beside the pods (the GPU operator installs it), never in them:
DCGM_SERIES.

Every selector in a query names its metric with braces (`name{...}`), so `selectors` reads
them back from the text; the tests compare them with what a served deployment publishes
(tests/test_gateway_app.py, tests/test_serve_supervisor.py) and parse every query with
promtool (tests/test_deploy_monitoring.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from enum import Enum
from typing import Any

from ..gateway import metrics as gm
from ..gateway.readiness import METRICS_PATH, SERVE_READY, SERVE_RESTARTS
from ..triton import contract as c
from ..triton import tensorrtllm_backend as tb


class Source(Enum):
    """Which page publishes a series."""

    TRITON = "triton"  # Triton's metrics port
    GATEWAY = "gateway"  # the gateway's /metrics
    SERVE = "serve"  # serve's health port, /metrics
    DCGM = "dcgm"  # NVIDIA's DCGM exporter, outside the pod


# Triton's own series (core metrics.cc; the counters have no _total suffix).
TRITON_SUCCESS = "nv_inference_request_success"
TRITON_FAILURE = "nv_inference_request_failure"
TRITON_QUEUE_US = "nv_inference_queue_duration_us"  # cumulative microseconds in the queue
# The DCGM exporter's default counters (NVIDIA/dcgm-exporter etc/default-counters.csv): GPU
# utilisation in %, frame buffer used and free in MiB. With its Kubernetes mapping on (the GPU
# operator's default) each series carries the `namespace` and `pod` of the pod using the GPU.
DCGM_GPU_UTIL = "DCGM_FI_DEV_GPU_UTIL"
DCGM_FB_USED = "DCGM_FI_DEV_FB_USED"
DCGM_FB_FREE = "DCGM_FI_DEV_FB_FREE"
DCGM_SERIES = (DCGM_GPU_UTIL, DCGM_FB_USED, DCGM_FB_FREE)
# The gateway's answer cache.
ANSWER_CACHE_SERIES = (gm.ANSWER_CACHE_LOOKUPS, gm.ANSWER_CACHE_EVICTIONS,
                       gm.ANSWER_CACHE_ENTRIES, gm.ANSWER_CACHE_BYTES)



def bucket(histogram: str) -> str:
    """The series a histogram is queried through."""
    return f"{histogram}_bucket"


SOURCES: dict[str, Source] = {
    **dict.fromkeys((TRITON_SUCCESS, TRITON_FAILURE, TRITON_QUEUE_US, c.LLM_REQUESTS_WAITING,
                     c.LLM_REQUESTS_RUNNING, bucket(c.LLM_QUEUE_WAIT), c.LLM_REQUESTS_REFUSED,
                     c.VISION_CACHE_HITS, c.VISION_CACHE_MISSES, tb.REQUEST_METRICS.family,
                     tb.KV_CACHE_METRICS.family), Source.TRITON),
    **dict.fromkeys((gm.REQUESTS, bucket(gm.TTFT), bucket(gm.INTER_TOKEN), gm.PROMPT_TOKENS,
                     gm.COMPLETION_TOKENS, *ANSWER_CACHE_SERIES), Source.GATEWAY),
    **dict.fromkeys((SERVE_RESTARTS, SERVE_READY), Source.SERVE),
    **dict.fromkeys(DCGM_SERIES, Source.DCGM),
}

# The kube-prometheus-stack chart's Grafana sidecar loads every ConfigMap with this label
# (prometheus-community/helm-charts charts/kube-prometheus-stack/values.yaml:
# grafana.sidecar.dashboards.label / labelValue).
DASHBOARD_LABEL = {"grafana_dashboard": "1"}
PERCENTILES = (0.5, 0.9, 0.99)
RATE = "$__rate_interval"  # Grafana's: at least four scrape intervals
ALERT_WINDOW = "5m"
# Alert thresholds.
ERROR_RATIO = 0.05  # of answered requests failing with a 5xx
QUEUE_WAIT_P90_S = 10.0  # seconds the slowest tenth waits for a batch slot
KV_CACHE_FRACTION = 0.95  # of the KV cache's blocks in use
# The engine's runtime preallocates kv_cache_free_gpu_mem_fraction (0.9) of the memory free
# at load, so a healthy GPU runs above 90% used; past this, a second process or a leak is
# pushing it to the end.
GPU_MEMORY_FRACTION = 0.98
# Matchers of the stock backend's series and the gateway's statuses.
FAILED = 'status!~"2.."'
SERVER_ERROR = 'status=~"5.."'
ACTIVE, MAX = 'request_type="active"', 'request_type="max"'
KV_FRACTION = 'kv_cache_block_type="fraction"'


def job(name: str, namespace: str) -> str:
    """The Prometheus Operator's job label of a PodMonitor's targets: NAMESPACE/NAME
    (prometheus-operator pkg/prometheus/promcfg.go, generatePodMonitorConfig)."""
    return f"{namespace}/{name}"


@dataclass(frozen=True)
class Queries:
    """The selectors of one deployment: `scope` matches its pods' series (the PodMonitor's
    job), `gpu` the DCGM exporter's of its pods."""

    scope: str
    gpu: str

    @classmethod
    def dashboard(cls, name: str) -> Queries:
        return cls(f'job="{job(name, "$namespace")}"',
                   f'namespace="$namespace", pod=~"{name}-.+"')

    @classmethod
    def alerts(cls, name: str) -> Queries:
        return cls(f'job=~"[^/]+/{name}"', f'pod=~"{name}-.+"')

    def of(self, metric: str, *matchers: str) -> str:
        """`metric{...}` within the deployment."""
        scope = self.gpu if SOURCES[metric] is Source.DCGM else self.scope
        return f"{metric}{{{', '.join((scope, *matchers))}}}"

    def rate(self, metric: str, *matchers: str, window: str = RATE) -> str:
        return f"rate({self.of(metric, *matchers)}[{window}])"

    def quantile(self, q: float, histogram: str, by: str = "", window: str = RATE) -> str:
        group = ", ".join(("le", *filter(None, [by])))
        return (f"histogram_quantile({q:g}, sum by ({group}) "
                f"({self.rate(bucket(histogram), window=window)}))")

    def hit_ratio(self, hits: str, lookups: str) -> str:
        return f"sum({hits}) / sum({lookups})"


def _panel(title: str, unit: str, targets: list[tuple[str, str]], description: str = "",
           ) -> dict[str, Any]:
    return {"type": "timeseries", "title": title, "description": description,
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "targets": [{"expr": expr, "legendFormat": legend} for expr, legend in targets]}


def _panels(q: Queries) -> list[dict[str, Any]]:
    status = q.rate(gm.REQUESTS)
    percentiles = lambda metric: [(q.quantile(p, metric), f"p{p * 100:g}")  # noqa: E731
                                  for p in PERCENTILES]
    return [
        _panel("Requests/s by status", "reqps",
               [(f"sum by (status) ({status})", "{{status}}")],
               "Chat completions answered by the gateway; 499: the client went away"),
        _panel("Errors/s by kind", "reqps", [
            (f"sum by (status) ({q.rate(gm.REQUESTS, FAILED)})", "HTTP {{status}}"),
            (f"sum by (reason) ({q.rate(c.LLM_REQUESTS_REFUSED)})", "busy: {{reason}}"),
            (f"sum by (model) ({q.rate(TRITON_FAILURE)})", "Triton {{model}}")]),
        _panel("Time to first token", "s", percentiles(gm.TTFT),
               "Request received to the first piece of answer (gateway)"),
        _panel("Inter-token latency", "s", percentiles(gm.INTER_TOKEN),
               "Between the tokens of an answer (gateway)"),
        _panel("Queue length", "short", [
            (f"sum({q.of(c.LLM_REQUESTS_WAITING)})", "waiting for a batch slot"),
            (f"sum({q.of(c.LLM_REQUESTS_RUNNING)})", "holding a batch slot")]),
        _panel("Queue wait", "s", [
            *percentiles(c.LLM_QUEUE_WAIT),
            (f"sum by (model) ({q.rate(TRITON_QUEUE_US)}) / 1e6 / "
             f"sum by (model) ({q.rate(TRITON_SUCCESS)})", "Triton queue, mean {{model}}")],
            "Waits for a batch slot of tensorrt_llm (percentiles); Triton's own queue per "
            "model step"),
        _panel("Batch slots in use", "percentunit", [(
            f"sum by (pod, model) ({q.of(tb.REQUEST_METRICS.family, ACTIVE)})"
            f" / sum by (pod, model) "
            f"({q.of(tb.REQUEST_METRICS.family, MAX)})", "{{pod}} {{model}}")]),
        _panel("KV cache in use", "percentunit", [(
            f"max by (pod, model) "
            f"({q.of(tb.KV_CACHE_METRICS.family, KV_FRACTION)})",
            "{{pod}} {{model}}")], "Fraction of the KV cache's blocks in use"),
        _panel("Cache hit rates", "percentunit", [
            (q.hit_ratio(q.rate(c.VISION_CACHE_HITS),
                         f"{q.rate(c.VISION_CACHE_HITS)} + {q.rate(c.VISION_CACHE_MISSES)}"),
             "vision cache"),
            (q.hit_ratio(q.rate(gm.ANSWER_CACHE_LOOKUPS, 'result="hit"'),
                         q.rate(gm.ANSWER_CACHE_LOOKUPS, 'result=~"hit|miss"')), "answer cache")],
            "Images whose prompt-table rows were cached; answers served from the gateway's "
            "cache (bypassed lookups not counted)"),
        _panel("Answer cache", "bytes", [
            (f"sum({q.of(gm.ANSWER_CACHE_BYTES)})", "bytes"),
            (f"sum({q.of(gm.ANSWER_CACHE_ENTRIES)})", "entries"),
            (f"sum by (reason) ({q.rate(gm.ANSWER_CACHE_EVICTIONS)})", "evicted/s: {{reason}}")]),
        _panel("Tokens/s", "short", [
            (f"sum({q.rate(gm.PROMPT_TOKENS)})", "in (prompt)"),
            (f"sum({q.rate(gm.COMPLETION_TOKENS)})", "out (completion)")]),
        _panel("Tenants: requests/s and tokens/s", "short", [
            (f"sum by (tenant, status) ({status})", "{{tenant}} HTTP {{status}}"),
            (f"sum by (tenant) ({q.rate(gm.PROMPT_TOKENS)}) + sum by (tenant) "
             f"({q.rate(gm.COMPLETION_TOKENS)})", "{{tenant}} tokens")],
            "Per tenant of the keys file (a 429 past a quota counts as HTTP 429)"),
        _panel("Pods ready and restarts", "short", [
            (f"sum({q.of(SERVE_READY)})", "ready"),
            (f"sum(increase({q.of(SERVE_RESTARTS)}[1h]))", "restarts in the last hour")]),
        _panel("GPU utilisation", "percent", [
            (f"avg by (pod, gpu) ({q.of(DCGM_GPU_UTIL)})", "{{pod}} GPU {{gpu}}")],
            "From NVIDIA's DCGM exporter"),
        _panel("GPU memory used", "percentunit", [
            (f"max by (pod, gpu) ({q.of(DCGM_FB_USED)} / ({q.of(DCGM_FB_USED)} + "
             f"{q.of(DCGM_FB_FREE)}))", "{{pod}} GPU {{gpu}}")],
            "From NVIDIA's DCGM exporter; the engine preallocates most of it for the KV cache"),
    ]


def dashboard(name: str) -> dict[str, Any]:
    """The Grafana dashboard (JSON model) of the deployment `name`, for any namespace
    (variable `namespace`) and Prometheus data source (variable `datasource`)."""
    source = {"type": "prometheus", "uid": "${datasource}"}
    panels = _panels(Queries.dashboard(name))
    width, height = 12, 8
    for index, panel in enumerate(panels):
        panel.update(id=index + 1, datasource=source,
                     gridPos={"x": (index % 2) * width, "y": (index // 2) * height,
                              "w": width, "h": height})
        for ref, target in enumerate(panel["targets"]):
            target.update(refId=chr(ord("A") + ref), datasource=source)
    namespaces = f"label_values({SERVE_READY}, namespace)"
    return {
        "uid": f"qvl-trt-{name}"[:40], "title": f"qvl-trt {name}", "tags": ["qvl-trt"],
        "schemaVersion": 39, "version": 1, "editable": True, "timezone": "browser",
        "time": {"from": "now-1h", "to": "now"}, "refresh": "30s",
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource",
             "query": "prometheus"},
            {"name": "namespace", "label": "Namespace", "type": "query", "datasource": source,
             "query": {"query": namespaces, "refId": "namespace"}, "definition": namespaces,
             "refresh": 2},
        ]},
        "panels": panels,
    }


def _alert(name: str, expr: str, for_: str, severity: str, summary: str,
           description: str) -> dict[str, Any]:
    return {"alert": name, "expr": expr, "for": for_, "labels": {"severity": severity},
            "annotations": {"summary": summary, "description": description,
                            "runbook": f"docs/deployment.md, Alerts: {name}"}}


def alert_rules(name: str) -> list[dict[str, Any]]:
    """The alerting rules of the deployment `name` (one Prometheus rule group's `rules`)."""
    q = Queries.alerts(name)
    w = ALERT_WINDOW
    return [
        _alert("QvlTrtServerRestarted", f"increase({q.of(SERVE_RESTARTS)}[15m]) > 0", "1m",
               "warning", "serve restarted tritonserver in {{ $labels.pod }}",
               "A dead python stub, failing probes or a wedged server made serve restart "
               "the server; the requests in flight failed."),
        _alert("QvlTrtErrorRate",
               f"sum by (namespace) ({q.rate(gm.REQUESTS, SERVER_ERROR, window=w)}) / "
               f"sum by (namespace) ({q.rate(gm.REQUESTS, window=w)}) > {ERROR_RATIO:g}",
               "5m", "critical", "{{ $value | humanizePercentage }} of requests fail with 5xx",
               f"More than {ERROR_RATIO:.0%} of the gateway's chat completions end with a "
               "server error (500, 503)."),
        _alert("QvlTrtQueueWaitHigh",
               f"{q.quantile(0.9, c.LLM_QUEUE_WAIT, by='namespace', window=w)} > "
               f"{QUEUE_WAIT_P90_S:g}",
               "10m", "warning", "requests wait {{ $value | humanizeDuration }} for a batch slot",
               f"The slowest tenth of requests wait more than {QUEUE_WAIT_P90_S:g} s for a "
               "batch slot of tensorrt_llm: every slot is busy."),
        _alert("QvlTrtKvCacheFull",
               f"max by (namespace, pod, model) "
               f"({q.of(tb.KV_CACHE_METRICS.family, KV_FRACTION)}) > "
               f"{KV_CACHE_FRACTION:g}",
               "5m", "warning", "the KV cache of {{ $labels.model }} in {{ $labels.pod }} is "
               "{{ $value | humanizePercentage }} full",
               "New requests wait for blocks to free: long answers or long prompts hold the "
               "cache."),
        _alert("QvlTrtGpuMemoryNearlyFull",
               f"max by (namespace, pod, gpu) ({q.of(DCGM_FB_USED)} / ({q.of(DCGM_FB_USED)} + "
               f"{q.of(DCGM_FB_FREE)})) > {GPU_MEMORY_FRACTION:g}",
               "10m", "warning", "GPU {{ $labels.gpu }} of {{ $labels.pod }} is "
               "{{ $value | humanizePercentage }} used",
               "Past what the engine preallocates for its KV cache: an allocation may fail."),
        _alert("QvlTrtPodNotReady", f"{q.of(SERVE_READY)} == 0", "5m", "critical",
               "{{ $labels.pod }} is not ready",
               "serve's /ready has answered 503 for 5 minutes: the pod gets no traffic."),
    ]


def manifests(name: str, meta: dict[str, Any], labels: dict[str, str],
              ) -> dict[str, dict[str, Any]]:
    """File name -> object: the PodMonitor (the three metrics pages of the pods with
    `labels`, by container port name: deploy/kubernetes.py), the PrometheusRule and the
    dashboard's ConfigMap."""
    named = lambda suffix: {**meta, "name": f"{name}{suffix}"}  # noqa: E731
    endpoints = [{"port": "metrics"}, {"port": "openai", "path": METRICS_PATH},
                 {"port": "health", "path": METRICS_PATH}]
    return {
        "podmonitor.yaml": {
            "apiVersion": "monitoring.coreos.com/v1", "kind": "PodMonitor", "metadata": meta,
            "spec": {"selector": {"matchLabels": labels}, "podMetricsEndpoints": endpoints}},
        "prometheusrule.yaml": {
            "apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": meta, "spec": {"groups": [{"name": f"{name}.rules",
                                                   "rules": alert_rules(name)}]}},
        "dashboard-configmap.yaml": {
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {**named("-dashboard"),
                         "labels": {**meta["labels"], **DASHBOARD_LABEL}},
            "data": {f"{name}.json": dashboard_json(name)}},
    }


def dashboard_json(name: str) -> str:
    return json.dumps(dashboard(name), indent=1) + "\n"


_SELECTOR = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)\{([^}]*)\}")
_MATCHER = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*"([^"]*)"')


def selectors(expr: str) -> list[tuple[str, tuple[tuple[str, str, str], ...]]]:
    """(metric, its (label, op, value) matchers) of each selector in `expr`."""
    return [(m[1], tuple(_MATCHER.findall(m[2]))) for m in _SELECTOR.finditer(expr)]


def expressions(name: str) -> list[str]:
    """Every query of the dashboard and the alerts, as written."""
    return [t["expr"] for p in dashboard(name)["panels"] for t in p["targets"]] + \
        [r["expr"] for r in alert_rules(name)]


def grafana_expanded(expr: str, namespace: str, rate_window: str = "1m") -> str:
    """A dashboard query as Grafana sends it, for `namespace` and a rate window."""
    return expr.replace("$namespace", namespace).replace(RATE, rate_window)
