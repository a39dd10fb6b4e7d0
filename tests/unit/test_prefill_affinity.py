"""P placement: keep the conversation's previous P while it is not overloaded, else the least loaded."""

from __future__ import annotations

import pytest

from gateway.engines.pool import EnginePool

URLS = ["http://p0", "http://p1", "http://p2"]


@pytest.mark.parametrize(("loads", "affinity", "slack", "picked"), [
    ([0, 0, 0], "http://p1", 0, "http://p1"),          # tie: the previous P
    ([500, 0, 0], "http://p0", 1000, "http://p0"),      # busier, but within the slack
    ([5000, 0, 0], "http://p0", 1000, None),             # overloaded: least loaded instead
    ([0, 300, 700], None, 1000, "http://p0"),            # no previous P: least loaded
    ([0, 300, 700], "http://gone", 1000, "http://p0"),   # previous P no longer in the pool
])
def test_pick_prefill_affinity(loads, affinity, slack, picked):
    pool = EnginePool("prefill", URLS)
    for engine, load in zip(pool.engines.values(), loads, strict=True):
        engine.outstanding_tokens = load
    chosen = pool.pick_prefill(affinity, slack).url
    if picked is None:
        assert chosen != affinity and pool.get(chosen).outstanding_tokens == min(loads)
    else:
        assert chosen == picked


def test_unhealthy_previous_p_is_not_kept():
    pool = EnginePool("prefill", URLS)
    pool.get("http://p0").healthy = False
    assert pool.pick_prefill("http://p0", 10_000).url != "http://p0"


def test_excluded_previous_p_is_not_kept():
    pool = EnginePool("prefill", URLS)
    assert pool.pick_prefill("http://p0", 10_000, exclude=frozenset({"http://p0"})).url != "http://p0"
