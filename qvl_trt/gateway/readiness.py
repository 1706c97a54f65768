"""Readiness as qvl-trt's HTTP endpoints answer it: serve's --health-port (the supervisor) and
the gateway's port give the same routes and the same replies. GET /ready: 200 and
{"ready": true, "reason": "ready"} while the deployment answers, else 503 and the reason;
GET /live: 200 while the process runs.

What "ready" means has one home, the supervisor (serve/supervisor.py: its end-to-end probe
answered and none failed since, every python model instance and the gateway run, no restart
is under way; a server that is merely busy stays ready, serve/liveness.py). A gateway
started by `qvl-trt serve` forwards the supervisor's answer (`GatewayOptions.ready_url`) once
it has found the builds Triton serves; only a gateway on its own, with no supervisor behind
it, asks Triton whether its models are ready."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

READY_PATH = "/ready"
LIVE_PATH = "/live"
METRICS_PATH = "/metrics"  # serve's: the two series below; the gateway's: gateway/metrics.py
READY = "ready"
# serve's metrics (Prometheus text): how often it restarted tritonserver, and whether GET
# /ready answers 200 now, as a pod's monitoring sees them (deploy/monitoring.py).
SERVE_RESTARTS = "qvl_serve_restarts_total"
SERVE_READY = "qvl_serve_ready"


def serve_metrics(ok: bool, restarts: int) -> bytes:
    """serve's GET /metrics page, in Prometheus' text format (0.0.4)."""
    return (f"# HELP {SERVE_RESTARTS} times serve restarted a faulty tritonserver\n"
            f"# TYPE {SERVE_RESTARTS} counter\n{SERVE_RESTARTS} {restarts}\n"
            f"# HELP {SERVE_READY} 1 while GET {READY_PATH} answers 200, else 0\n"
            f"# TYPE {SERVE_READY} gauge\n{SERVE_READY} {int(ok)}\n").encode()


def ready_reply(ok: bool, reason: str, restarts: int | None = None) -> tuple[int, dict]:
    """(HTTP status, JSON body) of GET /ready; serve's also says how often it restarted the
    server (`restarts`), so that a client sees a restart that readiness alone may hide."""
    body: dict = {"ready": ok, "reason": READY if ok else reason}
    if restarts is not None:
        body["restarts"] = restarts
    return (200 if ok else 503), body


def live_reply() -> tuple[int, dict]:
    return 200, {"live": True}


def ask_ready(url: str, timeout_s: float) -> tuple[bool, str] | None:
    """GET `url` (a /ready route): (ready, reason), or None while nothing answers there."""
    state = ready_state(url, timeout_s)
    if state is None:
        return None
    try:
        return bool(state["ready"]), str(state["reason"])
    except (KeyError, TypeError):
        return False, f"{url} answered {str(state)[:200]!r}, not a readiness reply"


def ready_state(url: str, timeout_s: float) -> dict | None:
    """GET `url` (a /ready route): its JSON body (serve's also counts its restarts), or None
    while nothing answers there."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:
            body = reply.read()
    except urllib.error.HTTPError as exc:
        body = exc.read()
    except (urllib.error.URLError, OSError):
        return None
    try:
        return json.loads(body)
    except ValueError:
        return {"body": body[:200].decode(errors="replace")}
