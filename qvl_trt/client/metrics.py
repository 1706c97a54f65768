"""LLM serving metrics over request timestamps, defined as NVIDIA genai-perf defines them.

- request latency = last response - request sent; time to first token (TTFT) = first
  response carrying output - request sent;
- inter-token latency (ITL) = (request latency - TTFT) / (output tokens - 1), only for
  requests with more than one output token; output tokens/s per user = 1 / ITL;
- benchmark duration = last response of all - first request sent; request throughput =
  successful requests / duration; output token throughput = output tokens / duration.

Input sequence length counts every prompt token the language model sees: text tokens plus
image (visual) tokens; both are also reported on their own.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MS = 1000.0


@dataclass(frozen=True)
class RequestRecord:
    """What one request saw. Times are seconds on one monotonic clock (time.perf_counter)."""

    sent: float
    first_token: float | None  # arrival of the first response carrying output
    last_response: float | None
    output_tokens: int = 0
    input_text_tokens: int = 0
    input_image_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.first_token is not None


@dataclass(frozen=True)
class Stats:
    avg: float
    min: float
    max: float
    std: float
    p50: float
    p90: float
    p99: float


# Per-request metrics: name -> unit. Order is the order of tables and CSV rows.
REQUEST_METRICS: dict[str, str] = {
    "request_latency": "ms",
    "time_to_first_token": "ms",
    "inter_token_latency": "ms",
    "output_token_throughput_per_user": "tokens/s",
    "output_sequence_length": "tokens",
    "input_sequence_length": "tokens",
    "input_text_tokens": "tokens",
    "input_image_tokens": "tokens",
}


@dataclass(frozen=True)
class LevelMetrics:
    """Everything measured at one concurrency."""

    concurrency: int
    requests: int
    errors: int
    duration_s: float
    request_throughput: float  # successful requests / s
    output_token_throughput: float  # output tokens / s, all requests together
    total_output_tokens: int
    total_input_text_tokens: int
    total_input_image_tokens: int
    metrics: dict[str, Stats | None]  # REQUEST_METRICS name -> stats (None: no sample)


def request_latency(r: RequestRecord) -> float:
    return r.last_response - r.sent


def time_to_first_token(r: RequestRecord) -> float:
    return r.first_token - r.sent


def inter_token_latency(r: RequestRecord) -> float | None:
    """Seconds between output tokens after the first; None for requests of one token."""
    if r.output_tokens < 2:
        return None
    return (request_latency(r) - time_to_first_token(r)) / (r.output_tokens - 1)


def output_token_throughput_per_user(r: RequestRecord) -> float | None:
    itl = inter_token_latency(r)
    return 1.0 / itl if itl else None


def describe(values: list[float]) -> Stats | None:
    """avg/min/max/std (population)/p50/p90/p99 (linear interpolation, numpy's default, as
    genai-perf); None for no values."""
    if not values:
        return None
    a = np.asarray(values, dtype=np.float64)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return Stats(
        float(a.mean()),
        float(a.min()),
        float(a.max()),
        float(a.std()),
        float(p50),
        float(p90),
        float(p99),
    )


def per_request_values(records: list[RequestRecord]) -> dict[str, list[float]]:
    """REQUEST_METRICS name -> one value per successful request (latencies in ms)."""
    ok = [r for r in records if r.ok]
    itls = [v for v in map(inter_token_latency, ok) if v is not None]
    return {
        "request_latency": [request_latency(r) * MS for r in ok],
        "time_to_first_token": [time_to_first_token(r) * MS for r in ok],
        "inter_token_latency": [v * MS for v in itls],
        "output_token_throughput_per_user": [1.0 / v for v in itls if v > 0],
        "output_sequence_length": [float(r.output_tokens) for r in ok],
        "input_sequence_length": [float(r.input_text_tokens + r.input_image_tokens) for r in ok],
        "input_text_tokens": [float(r.input_text_tokens) for r in ok],
        "input_image_tokens": [float(r.input_image_tokens) for r in ok],
    }


def level_metrics(concurrency: int, records: list[RequestRecord]) -> LevelMetrics:
    """Aggregate one concurrency level's records."""
    ok = [r for r in records if r.ok]
    duration = (max(r.last_response for r in ok) - min(r.sent for r in records)) if ok else 0.0
    out_tokens = sum(r.output_tokens for r in ok)
    return LevelMetrics(
        concurrency=concurrency,
        requests=len(records),
        errors=len(records) - len(ok),
        duration_s=duration,
        request_throughput=len(ok) / duration if duration > 0 else 0.0,
        output_token_throughput=out_tokens / duration if duration > 0 else 0.0,
        total_output_tokens=out_tokens,
        total_input_text_tokens=sum(r.input_text_tokens for r in ok),
        total_input_image_tokens=sum(r.input_image_tokens for r in ok),
        metrics={name: describe(values) for name, values in per_request_values(records).items()},
    )
