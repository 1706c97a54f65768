"""The gateway's Prometheus metrics (GET /metrics), in a registry of its own. Requests and tokens
carry the tenant (gateway/tenants.py; "-" where no key is asked or none matched): at most
tenants.MAX_TENANTS per keys file, so the label's values stay bounded (a tenant removed from
the file keeps its series until the gateway restarts)."""

from __future__ import annotations

import time

from ..deps import require

# Seconds: from a cached short answer on a GPU to a long one on a CPU reference deployment.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300)
# An HTTP status for a request whose client went away before its answer (nginx's).
CLIENT_CLOSED = 499
# Seconds between two tokens of an answer: from a GPU's few milliseconds to a loaded CPU's.
INTER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28,
                       2.5, 5)

# The series on the metrics page (a counter's name carries its _total, a histogram's its
# _seconds); deploy/monitoring.py's dashboard and alerts query them.
REQUESTS = "qvl_gateway_requests_total"
REROUTED = "qvl_gateway_rerouted_total"
LATENCY = "qvl_gateway_request_duration_seconds"
TTFT = "qvl_gateway_time_to_first_token_seconds"
INTER_TOKEN = "qvl_gateway_inter_token_latency_seconds"
PROMPT_TOKENS = "qvl_gateway_prompt_tokens_total"
COMPLETION_TOKENS = "qvl_gateway_completion_tokens_total"
IN_FLIGHT = "qvl_gateway_requests_in_flight"
ANSWER_CACHE_LOOKUPS = "qvl_gateway_answer_cache_lookups_total"  # labels model, result
ANSWER_CACHE_EVICTIONS = "qvl_gateway_answer_cache_evictions_total"  # label reason
ANSWER_CACHE_ENTRIES = "qvl_gateway_answer_cache_entries"
ANSWER_CACHE_BYTES = "qvl_gateway_answer_cache_bytes"
WAITING = "qvl_gateway_requests_waiting"
QUOTA_REFUSALS = "qvl_gateway_quota_refusals_total"
KEYS_GENERATION = "qvl_gateway_keys_generation"
KEYS_RELOAD_FAILURES = "qvl_gateway_keys_reload_failures_total"


class GatewayMetrics:
    def __init__(self) -> None:
        prom = require("prometheus_client", extra="gateway", why="export the gateway's metrics")
        self._prom = prom
        self.registry = prom.CollectorRegistry()
        kw = {"registry": self.registry}
        self.requests = prom.Counter(
            REQUESTS, "Chat completion requests by model, the build that answered "
            f"(or refused last), streaming and HTTP status ({CLIENT_CLOSED}: the client went "
            "away), by tenant", ["tenant", "model", "build", "stream", "status"], **kw)
        self.rerouted = prom.Counter(
            REROUTED, "Requests a build refused above its engine limits, sent on "
            "to a larger build of the model", ["model", "build"], **kw)
        self.latency = prom.Histogram(
            LATENCY, "Request received to last byte sent, "
            "answered requests", ["model", "stream"], buckets=LATENCY_BUCKETS, **kw)
        self.ttft = prom.Histogram(
            TTFT, "Request received to the first piece of "
            "answer from Triton", ["model"], buckets=LATENCY_BUCKETS, **kw)
        self.inter_token = prom.Histogram(
            INTER_TOKEN, "Seconds between an answer's pieces from Triton, per token (a piece "
            "of n tokens counts n gaps of its wait / n)", ["model"], buckets=INTER_TOKEN_BUCKETS,
            **kw)
        self.prompt_tokens = prom.Counter(
            PROMPT_TOKENS, "Prompt tokens (visual tokens included) of answered "
            "requests", ["tenant", "model"], **kw)
        self.completion_tokens = prom.Counter(
            COMPLETION_TOKENS, "Generated tokens of answered requests",
            ["tenant", "model"], **kw)
        self.in_flight = prom.Gauge(
            IN_FLIGHT, "Chat completion requests being answered", **kw)
        self.answer_cache_lookups = prom.Counter(
            ANSWER_CACHE_LOOKUPS, "Chat completion requests by model and how the "
            "answer cache took them: hit, miss, or bypass (not cacheable, opted out, or the "
            "cache is off)", ["model", "result"], **kw)
        self.answer_cache_evictions = prom.Counter(
            ANSWER_CACHE_EVICTIONS, "Answers dropped from the answer cache, by "
            "the bound that dropped them: capacity (entries), bytes, ttl (age)", ["reason"],
            **kw)
        # Every reason from the start, so a dashboard's rate reads 0 rather than no data.
        from ..lru import EVICTED_FOR_BYTES, EVICTED_FOR_ENTRIES
        from .answer_cache import EVICTED_FOR_AGE

        for reason in (EVICTED_FOR_ENTRIES, EVICTED_FOR_BYTES, EVICTED_FOR_AGE):
            self.answer_cache_evictions.labels(reason)
        self.answer_cache_entries = prom.Gauge(
            ANSWER_CACHE_ENTRIES, "Answers held by the answer cache", **kw)
        self.answer_cache_bytes = prom.Gauge(
            ANSWER_CACHE_BYTES, "Bytes held by the answer cache", **kw)
        self.waiting = prom.Gauge(
            WAITING, "Chat completion requests waiting for one of the gateway's slots", **kw)
        self.quota_refusals = prom.Counter(
            QUOTA_REFUSALS, "Requests refused (429) past a quota of their tenant, by the "
            "quota", ["tenant", "limit"], **kw)
        self.keys_generation = prom.Gauge(
            KEYS_GENERATION, "Loads of the keys file (1: the one at start; each rewrite the "
            "gateway took adds 1)", **kw)
        self.keys_reload_failures = prom.Counter(
            KEYS_RELOAD_FAILURES, "Rewrites of the keys file that could not be read (the "
            "keys of the last good one stay)", **kw)

    def exposition(self) -> tuple[bytes, str]:
        """The metrics page and its content type."""
        return self._prom.generate_latest(self.registry), self._prom.CONTENT_TYPE_LATEST


class TokenGaps:
    """The inter-token latency of one answer, observed as its pieces arrive: each piece's wait
    since the one before, shared by the tokens it brought."""

    def __init__(self, histogram, completion_tokens: int) -> None:
        """`histogram`: the answer's child of GatewayMetrics.inter_token; `completion_tokens`:
        the first piece's count."""
        self._histogram = histogram
        self._at = time.perf_counter()
        self._tokens = completion_tokens

    def piece(self, completion_tokens: int) -> None:
        """A piece arrived; `completion_tokens`: the answer's tokens so far."""
        new = completion_tokens - self._tokens
        if new <= 0:
            return
        now = time.perf_counter()
        gap = (now - self._at) / new
        for _ in range(new):
            self._histogram.observe(gap)
        self._at, self._tokens = now, completion_tokens
