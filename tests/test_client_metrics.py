"""Benchmark metrics over hand-computed timestamps (genai-perf's definitions)."""

from __future__ import annotations

import math

import pytest

from qvl_trt.client.metrics import (
    RequestRecord,
    describe,
    inter_token_latency,
    level_metrics,
    output_token_throughput_per_user,
    request_latency,
    time_to_first_token,
)

# sent, first token, last response, output tokens, text tokens, image tokens
A = RequestRecord(0.0, 0.1, 0.5, 5, 20, 64)  # latency 500 ms, TTFT 100, ITL 100 ms
B = RequestRecord(0.2, 0.5, 0.5, 1, 10, 0)  # latency 300, TTFT 300, one token: no ITL
C = RequestRecord(0.3, 0.4, 1.0, 9, 30, 256)  # latency 700, TTFT 100, ITL 600/8 = 75 ms
FAILED = RequestRecord(0.05, None, None, error="server said no")


def test_per_request_definitions():
    assert request_latency(A) == pytest.approx(0.5)
    assert time_to_first_token(A) == pytest.approx(0.1)
    assert inter_token_latency(A) == pytest.approx(0.1)
    assert output_token_throughput_per_user(A) == pytest.approx(10.0)
    assert inter_token_latency(B) is None and output_token_throughput_per_user(B) is None
    assert inter_token_latency(C) == pytest.approx(0.075)
    assert output_token_throughput_per_user(C) == pytest.approx(1 / 0.075)


def test_describe_uses_population_std_and_linear_percentiles():
    s = describe([500.0, 300.0, 700.0])
    assert (s.avg, s.min, s.max) == (500.0, 300.0, 700.0)
    assert s.std == pytest.approx(math.sqrt((0 + 200**2 + 200**2) / 3))
    # sorted [300, 500, 700]: p90 at rank 1.8 -> 500 + 0.8 * 200
    assert (s.p50, s.p90, s.p99) == pytest.approx((500.0, 660.0, 696.0))
    assert describe([]) is None
    one = describe([4.0])
    assert (one.avg, one.std, one.p99) == (4.0, 0.0, 4.0)


def test_level_aggregates():
    m = level_metrics(4, [A, B, C, FAILED])
    assert (m.concurrency, m.requests, m.errors) == (4, 4, 1)
    # last response of all (1.0) - first request sent (0.0, the failed one included)
    assert m.duration_s == pytest.approx(1.0)
    assert m.request_throughput == pytest.approx(3.0)
    assert m.total_output_tokens == 15 and m.output_token_throughput == pytest.approx(15.0)
    assert (m.total_input_text_tokens, m.total_input_image_tokens) == (60, 320)
    lat = m.metrics["request_latency"]
    assert (lat.avg, lat.min, lat.max) == pytest.approx((500.0, 300.0, 700.0))
    ttft = m.metrics["time_to_first_token"]
    assert (ttft.avg, ttft.p50) == pytest.approx((500.0 / 3, 100.0))
    itl = m.metrics["inter_token_latency"]  # B has one token and is left out
    assert (itl.avg, itl.min, itl.max) == pytest.approx((87.5, 75.0, 100.0))
    per_user = m.metrics["output_token_throughput_per_user"]
    assert (per_user.min, per_user.max) == pytest.approx((10.0, 1 / 0.075))
    isl = m.metrics["input_sequence_length"]  # text + image tokens
    assert (isl.min, isl.max) == (10.0, 286.0)
    assert m.metrics["input_image_tokens"].max == 256.0
    assert m.metrics["output_sequence_length"].avg == 5.0


def test_a_level_where_everything_failed():
    m = level_metrics(1, [FAILED])
    assert (m.errors, m.duration_s, m.request_throughput, m.total_output_tokens) == (1, 0, 0, 0)
    assert all(v is None for v in m.metrics.values())
