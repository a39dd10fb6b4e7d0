"""The gateway's own time per turn (turns/intake/clock.py): spans between marks, engine waits taken out of `internal`."""

from __future__ import annotations

import pytest

from gateway.telemetry import Metrics
from gateway.turns.intake import clock as clocks
from gateway.turns.intake.clock import SPANS, TurnClock


@pytest.fixture
def ticks(monkeypatch):
    """A hand-driven perf_counter: each test says what time each mark reads."""
    now = [0.0]
    monkeypatch.setattr(clocks, "_now", lambda: now[0])
    return now


def _sample(metrics: Metrics, span: str, kind: str) -> float:
    return metrics.registry.get_sample_value(f"pdgw_gateway_seconds_{kind}", {"span": span}) or 0.0


def test_a_local_turn_without_a_p_leg_has_its_own_first_span(ticks):
    clock = TurnClock(None, received=0.0)
    for at, mark in ((0.0003, clock.decode_out), (0.0103, clock.decode_in), (0.0104, clock.delivered)):
        ticks[0] = at
        mark()
    spans = clock.spans()
    assert set(spans) == {"to_decode", "to_client", "internal"}
    assert spans["to_decode"] == pytest.approx(0.0003) and spans["internal"] == pytest.approx(0.0004)


def test_spans_and_internal_time_of_one_turn(ticks):
    metrics = Metrics()
    clock = TurnClock(metrics.gateway_seconds, received=0.0)
    for at, mark in ((0.0004, clock.prefill_out), (0.0104, clock.prefill_in), (0.0106, clock.decode_out),
                     (0.0206, clock.decode_in), (0.0207, clock.delivered)):
        ticks[0] = at
        mark()
    spans = clock.spans()
    assert spans["to_prefill"] == pytest.approx(0.0004)
    assert spans["prefill_to_decode"] == pytest.approx(0.0002)
    assert spans["to_client"] == pytest.approx(0.0001)
    # 20.7 ms in all, of which 20 ms waiting for P and D: the gateway's own share is the rest
    assert spans["internal"] == pytest.approx(0.0007)
    for span in SPANS:
        assert _sample(metrics, span, "count") == (span != "to_decode")      # a turn with a P leg
    assert _sample(metrics, "internal", "sum") == pytest.approx(0.0007)
    assert metrics.registry.get_sample_value(
        "pdgw_gateway_seconds_bucket", {"span": "internal", "le": "0.0008"}) == 1     # sub-ms buckets
    assert metrics.registry.get_sample_value(
        "pdgw_gateway_seconds_bucket", {"span": "internal", "le": "0.0006"}) == 0


def test_a_failed_attempt_counts_as_engine_wait_and_delivery_is_observed_once(ticks):
    metrics = Metrics()
    clock = TurnClock(metrics.gateway_seconds, received=0.0)
    ticks[0] = 0.001
    clock.prefill_out()             # first P times out: no answer mark
    ticks[0] = 0.501
    clock.prefill_out()             # retried without the handle
    ticks[0] = 0.511
    clock.prefill_in()
    ticks[0] = 0.512
    clock.decode_out()
    ticks[0] = 0.522
    clock.decode_in()
    ticks[0] = 0.523
    clock.decode_in()               # later events do not move D's first byte
    clock.delivered()
    clock.delivered()
    assert clock.spans()["internal"] == pytest.approx(0.003)
    assert clock.spans()["to_client"] == pytest.approx(0.001)
    assert _sample(metrics, "internal", "count") == 1


def test_a_turn_that_failed_before_d_answered_observes_only_what_it_has(ticks):
    clock = TurnClock(None, received=0.0)
    ticks[0] = 0.001
    clock.prefill_out()
    ticks[0] = 0.002
    clock.delivered()               # an error body went out
    assert set(clock.spans()) == {"to_prefill", "internal"}
