"""The gateway's Prometheus metrics (GET /metrics), in a registry of its own."""

from __future__ import annotations

from ..deps import require

# Seconds: from a cached short answer on a GPU to a long one on a CPU reference deployment.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300)
# An HTTP status for a request whose client went away before its answer (nginx's).
CLIENT_CLOSED = 499


class GatewayMetrics:
    def __init__(self) -> None:
        prom = require("prometheus_client", extra="gateway", why="export the gateway's metrics")
        self._prom = prom
        self.registry = prom.CollectorRegistry()
        kw = {"registry": self.registry}
        self.requests = prom.Counter(
            "qvl_gateway_requests", "Chat completion requests by model, the build that answered "
            f"(or refused last), streaming and HTTP status ({CLIENT_CLOSED}: the client went "
            "away)", ["model", "build", "stream", "status"], **kw)
        self.rerouted = prom.Counter(
            "qvl_gateway_rerouted", "Requests a build refused above its engine limits, sent on "
            "to a larger build of the model", ["model", "build"], **kw)
        self.latency = prom.Histogram(
            "qvl_gateway_request_duration_seconds", "Request received to last byte sent, "
            "answered requests", ["model", "stream"], buckets=LATENCY_BUCKETS, **kw)
        self.ttft = prom.Histogram(
            "qvl_gateway_time_to_first_token_seconds", "Request received to the first piece of "
            "answer from Triton", ["model"], buckets=LATENCY_BUCKETS, **kw)
        self.prompt_tokens = prom.Counter(
            "qvl_gateway_prompt_tokens", "Prompt tokens (visual tokens included) of answered "
            "requests", ["model"], **kw)
        self.completion_tokens = prom.Counter(
            "qvl_gateway_completion_tokens", "Generated tokens of answered requests",
            ["model"], **kw)
        self.in_flight = prom.Gauge(
            "qvl_gateway_requests_in_flight", "Chat completion requests being answered", **kw)
        self.answer_cache_lookups = prom.Counter(
            "qvl_gateway_answer_cache_lookups", "Chat completion requests by model and how the "
            "answer cache took them: hit, miss, or bypass (not cacheable, opted out, or the "
            "cache is off)", ["model", "result"], **kw)
        self.answer_cache_evictions = prom.Counter(
            "qvl_gateway_answer_cache_evictions", "Answers dropped from the answer cache, by "
            "the bound that dropped them: capacity (entries), bytes, ttl (age)", ["reason"],
            **kw)
        self.answer_cache_entries = prom.Gauge(
            "qvl_gateway_answer_cache_entries", "Answers held by the answer cache", **kw)
        self.answer_cache_bytes = prom.Gauge(
            "qvl_gateway_answer_cache_bytes", "Bytes held by the answer cache", **kw)

    def exposition(self) -> tuple[bytes, str]:
        """The metrics page and its content type."""
        return self._prom.generate_latest(self.registry), self._prom.CONTENT_TYPE_LATEST
