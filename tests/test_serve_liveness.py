"""Busy or dead (qvl_trt/serve/liveness.py), driven with hand-made times: a probe that waits
while the server progresses is busy, never a fault; one that waits with no progress is a
wedge; the deadline holds whatever the progress; failed probes count, busy refusals do not.
The rule serve had before (a probe unanswered after 20 s is a failure, two in a row a
restart) restarts the busy server of the same events: `old_rule`. And the progress counters
read from a metrics page (serve/progress.py)."""

from __future__ import annotations

import pytest

from qvl_trt.errors import ConfigError
from qvl_trt.serve.liveness import Liveness, LivenessRules, Outcome
from qvl_trt.serve.progress import parse_metrics, progress_counters, total

RULES = LivenessRules(probe_interval_s=5, stall_timeout_s=60, probe_deadline_s=900,
                      probe_failures=2)


def answered(now: float) -> Liveness:
    """A server whose first probe answered at `now`."""
    live = Liveness(RULES, 0.0)
    live.probe_sent(0.0)
    live.probe_done(Outcome.ANSWERED, now)
    return live


def old_rule(probe_sent: float, now: float, timeout_s: float = 20, failures: int = 2) -> bool:
    """serve's rule before: a probe without an answer after `timeout_s` failed, and the next
    probe went out at once; `failures` such in a row restarted the server."""
    return now - probe_sent >= timeout_s * failures


def test_a_probe_that_waits_while_the_server_progresses_is_busy() -> None:
    live = answered(1.0)
    live.probe_sent(10.0)
    for t in range(10, 400, 7):  # tokens keep coming: the counters move at every reading
        live.progress((float(t),), float(t))
        assert live.fault(float(t)) is None, t
        assert live.readiness() == (True, "")
    assert live.busy(400.0)
    # the same events under the old rule: a restart 40 s in, killing every answer in flight
    assert old_rule(10.0, 50.0)


def test_no_progress_while_a_probe_waits_is_a_wedge() -> None:
    live = answered(1.0)
    live.probe_sent(10.0)
    live.progress((5.0, 3.0), 10.5)  # the first reading starts the stall clock
    for t in (20.0, 40.0, 70.0):
        live.progress((5.0, 3.0), t)
        assert live.fault(t) is None
    live.progress((5.0, 3.0), 70.5)
    fault = live.fault(70.5)
    assert fault is not None and "no progress for 60 s" in fault and "--stall-timeout" in fault


def test_progress_that_stops_while_the_probe_waits_is_a_wedge_a_stall_timeout_later() -> None:
    live = answered(1.0)
    live.probe_sent(10.0)
    for t in range(10, 200, 10):
        live.progress((float(t),), float(t))
    assert live.fault(249.9) is None  # last change at 190
    assert live.fault(250.0) is not None


def test_unreadable_metrics_are_no_progress() -> None:
    live = answered(1.0)
    live.probe_sent(10.0)
    live.progress(None, 30.0)
    live.progress(None, 69.0)
    assert live.fault(69.0) is None
    assert live.fault(70.0) is not None


def test_the_deadline_holds_whatever_the_progress() -> None:
    live = answered(1.0)
    live.probe_sent(10.0)
    for t in range(10, 910, 10):
        live.progress((float(t),), float(t))
    assert live.fault(909.0) is None
    fault = live.fault(910.0)
    assert fault is not None and "--probe-deadline 900" in fault


def test_a_new_probe_restarts_the_stall_clock_from_its_first_reading() -> None:
    live = answered(1.0)
    live.probe_sent(100.0)
    live.progress((1.0,), 100.5)
    live.probe_done(Outcome.ANSWERED, 101.0)
    live.probe_sent(500.0)  # the counters read before it are no baseline for it
    live.progress((1.0,), 500.5)
    assert live.fault(560.0) is None
    assert live.fault(560.5) is not None


def test_failures_count_in_a_row_and_busy_refusals_do_not() -> None:
    live = answered(1.0)
    live.probe_sent(10.0)
    live.probe_done(Outcome.FAILED, 10.1, "ensemble: Connection refused")
    assert live.readiness() == (False, "probe failed: ensemble: Connection refused")
    assert live.fault(10.1) is None
    live.probe_sent(15.0)
    live.probe_done(Outcome.BUSY, 15.1)  # says nothing: the count stays
    assert live.failures == 1 and live.fault(15.1) is None
    live.probe_sent(20.0)
    live.probe_done(Outcome.FAILED, 20.1, "ensemble: HTTP 400 not healthy")
    assert "failed 2 times in a row (ensemble: HTTP 400 not healthy)" in live.fault(20.1)
    live.restarted(30.0)
    assert live.fault(30.0) is None and live.readiness() == (False, "first probe pending")
    live.probe_sent(31.0)
    live.probe_done(Outcome.ANSWERED, 31.5)
    assert live.readiness() == (True, "")


def test_a_busy_refusal_keeps_readiness() -> None:
    live = answered(1.0)
    live.probe_sent(10.0)
    live.probe_done(Outcome.BUSY, 10.1)
    assert live.readiness() == (True, "")
    fresh = Liveness(RULES, 0.0)
    fresh.probe_sent(0.0)
    fresh.probe_done(Outcome.BUSY, 0.1)
    assert fresh.readiness() == (False, "first probe pending")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"stall_timeout_s": 0}, "--stall-timeout 0 must be a positive number"),
    ({"probe_interval_s": -1}, "--probe-interval -1 must be a positive number"),
    ({"stall_timeout_s": 100, "probe_deadline_s": 50}, "--probe-deadline 50 is below "
     "--stall-timeout 100"),
])
def test_rules_are_checked(kwargs, message) -> None:
    with pytest.raises(ConfigError, match=message):
        LivenessRules(**kwargs)


PAGE = r'''# HELP nv_inference_request_success Number of successful inference requests
# TYPE nv_inference_request_success counter
nv_inference_request_success{model="ensemble",version="1"} 4
nv_inference_request_success{model="tensorrt_llm",version="1"} 17
nv_inference_request_failure{model="tensorrt_llm",version="1"} 2
nv_inference_exec_count{model="preprocessing",version="1"} 9
nv_trt_llm_general_metrics{general_type="iteration_counter",model="a_tensorrt_llm",version="1"} 120
nv_trt_llm_general_metrics{general_type="timestamp",model="a_tensorrt_llm",version="1"} 1.79e+15
nv_trt_llm_general_metrics{general_type="iteration_counter",model="b_tensorrt_llm",version="1"} 30
qvl_odd{note="a \"quoted\" \\ value",model="x"} 1.5 1700000000000
qvl_llm_queue_wait_seconds_bucket{instance="p_0_0",model="p",le="+Inf"} 3
not a sample line
'''


def test_progress_counters_sum_iterations_and_triton_counters() -> None:
    samples = parse_metrics(PAGE)
    assert progress_counters(samples) == (150.0, 21.0, 2.0, 9.0)
    assert total(samples, "qvl_odd", note='a "quoted" \\ value') == 1.5
    assert total(samples, "qvl_llm_queue_wait_seconds_bucket", le="+Inf") == 3
    assert total(samples, "nv_trt_llm_general_metrics", general_type="timestamp") == 1.79e15
