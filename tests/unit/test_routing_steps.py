"""Routing's declared steps one by one: filters, scorers, the settings a pick is made from."""

import pytest

from gateway.config import Settings
from gateway.engines import routing
from gateway.engines.engine import Engine
from gateway.errors import EngineUnavailableError

WANT = routing.Want(now=100.0, exclude=frozenset({"http://x"}), previous="http://a", slack_tokens=10,
                    load_bound=2)


def engine(url: str = "http://a", **state) -> Engine:
    e = Engine(url, "decode")
    for key, value in state.items():
        setattr(e, key, value)
    return e


@pytest.mark.parametrize(("step", "e", "kept"), [
    (routing.HEALTHY, engine(), True),
    (routing.HEALTHY, engine(healthy=False), False),
    (routing.NOT_FAILED_THIS_TURN, engine("http://x"), False),
    (routing.NOT_FAILED_THIS_TURN, engine("http://y"), True),
])
def test_filters(step, e, kept):
    assert step.keep(e, WANT) is kept


@pytest.mark.parametrize(("scorer", "e", "score"), [
    (routing.queued_tokens, engine(outstanding_tokens=300), 300),
    (routing.outstanding_requests, engine(outstanding_requests=3), 3),
    (routing.previous_prefill, engine("http://a"), -10.5),
    (routing.previous_prefill, engine("http://b"), 0.0),
    (routing.holder, engine("http://a", outstanding_requests=1), float("-inf")),
    (routing.holder, engine("http://a", outstanding_requests=2), 0.0),       # at its load bound: left
    (routing.holder, engine("http://b"), 0.0),
])
def test_scorers(scorer, e, score):
    assert scorer(e, WANT) == score


def test_a_soft_filter_that_would_leave_nothing_is_skipped():
    picker = routing.Picker("decode")
    always_out = routing.Filter(lambda e, w: False, soft=True)
    profile = routing.Profile((routing.HEALTHY, always_out), (routing.outstanding_requests,))
    assert picker.pick([engine()], profile, WANT).url == "http://a"
    with pytest.raises(EngineUnavailableError):
        picker.pick([engine(healthy=False)], profile, WANT)


def test_want_reads_the_settings():
    settings = Settings(prefill_affinity=False, decode_load_bound=5, prefill_affinity_slack_tokens=7)
    assert routing.want("prefill", settings, "http://p").previous is None
    assert routing.want("decode", settings, "http://d").load_bound == 5
    assert routing.want("prefill", Settings(prefill_affinity_slack_tokens=7), "http://p").slack_tokens == 7
