"""Metrics' label children are looked up from a cache (gateway/telemetry.py): the same child the library gives,
forgotten on removal, and the exposition unchanged."""

from __future__ import annotations

from enum import Enum, StrEnum

from prometheus_client import CollectorRegistry
from prometheus_client import Counter as LibraryCounter

from gateway.telemetry import Counter, Gauge, Histogram, Metrics


class Kind(StrEnum):
    REUSE = "reuse"


class Mixed(str, Enum):            # equal to "reuse", but its str() is "Mixed.REUSE"
    REUSE = "reuse"


def test_the_cached_child_is_the_librarys():
    m = Metrics()
    child = m.turns.labels("reuse", "continuous")
    assert m.turns.labels("reuse", "continuous") is child
    assert m.turns.labels(Kind.REUSE, "continuous") is child
    assert m.turns.labels(plan="reuse", reason="continuous") is child
    child.inc()
    assert m.registry.get_sample_value("pdgw_turns_total", {"model": "", "plan": "reuse", "reason": "continuous"}) == 1


def test_each_model_s_turns_are_counted_under_its_name():
    m = Metrics()
    m.for_model("a").turns.labels("reuse", "continuous").inc()
    m.for_model("b").turns.labels("full", "first_turn").inc(2)
    assert m.registry.get_sample_value("pdgw_turns_total", {"model": "a", "plan": "reuse", "reason": "continuous"}) == 1
    assert m.registry.get_sample_value("pdgw_turns_total", {"model": "b", "plan": "full", "reason": "first_turn"}) == 2
    assert m.for_model("a").registry is m.registry and m.for_model("a").engine_names is m.engine_names


def test_values_that_are_not_their_own_str_are_not_cached():
    counter = Counter("c", "c", ["k"], registry=CollectorRegistry())
    assert counter.labels(Mixed.REUSE) is not counter.labels("reuse")
    assert counter.labels(1) is counter.labels("1")          # the library's own conversion


def test_a_removed_child_is_made_anew():
    gauge = Gauge("g", "g", ["pool", "engine"], registry=CollectorRegistry())
    first = gauge.labels("decode", "http://d")
    first.set(1)
    gauge.remove("decode", "http://d")
    second = gauge.labels("decode", "http://d")
    assert second is not first and second._value.get() == 0
    gauge.clear()
    assert gauge.labels("decode", "http://d") is not second


def test_exposition_is_the_librarys():
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    a = Counter("x", "help", ["k"], registry=ours)
    b = LibraryCounter("x", "help", ["k"], registry=theirs)
    for counter in (a, b):
        counter.labels("one").inc(2)
        counter.labels("two").inc()
    from prometheus_client import generate_latest
    text = generate_latest(ours).decode()
    assert [line for line in text.splitlines() if not line.startswith("x_created")] == \
        [line for line in generate_latest(theirs).decode().splitlines() if not line.startswith("x_created")]
    h = Histogram("h", "h", ["span"], registry=ours)
    h.labels("internal").observe(0.001)
    assert ours.get_sample_value("h_count", {"span": "internal"}) == 1
