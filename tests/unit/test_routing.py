"""Routing steps and bounds, table-driven: filter (health, breaker), score (load, ramp), pick; admission."""

import pytest

from gateway.engines import engine as pool_module
from gateway.engines.pool import EnginePool
from gateway.errors import EngineUnavailableError, OverloadedError
from gateway.turns.run.admission import Admission


def pool(n: int = 3) -> EnginePool:
    return EnginePool("decode", [f"http://d{i}" for i in range(n)])


def test_least_loaded_with_round_robin_ties():
    p = pool()
    assert len({p.pick_decode().url for _ in range(3)}) == 3
    p.engines["http://d0"].outstanding_requests = 0
    p.engines["http://d1"].outstanding_requests = 5
    p.engines["http://d2"].outstanding_requests = 5
    assert {p.pick_decode().url for _ in range(5)} == {"http://d0"}


def test_affinity_holds_until_the_load_bound():
    p = pool()
    p.engines["http://d1"].outstanding_requests = 3
    assert p.pick_decode("http://d1", load_bound=4).url == "http://d1"
    assert p.pick_decode("http://d1", load_bound=3).url != "http://d1"


def test_unhealthy_and_excluded_engines_are_filtered():
    p = pool(2)
    p.engines["http://d0"].healthy = False
    assert p.pick_decode("http://d0").url == "http://d1"
    with pytest.raises(EngineUnavailableError):
        p.pick_decode(exclude=frozenset({"http://d1"}))


def test_breaker_ejects_after_consecutive_failures_then_half_opens(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(pool_module.time, "monotonic", lambda: now[0])
    p = pool(2)
    d0 = p.engines["http://d0"]
    for _ in range(pool_module.FAILURES_TO_EJECT):
        d0.failed()
    assert {p.pick_decode().url for _ in range(4)} == {"http://d1"}
    now[0] += pool_module.EJECT_COOLDOWN_S
    with d0.track():                                     # half-open: one trial request at a time
        assert not d0.available(now[0])
        d0.succeeded()
    assert d0.available(now[0]) and d0.ramp(now[0]) == 1.0


def test_all_ejected_means_panic_mode_not_503():
    p = pool(2)
    for engine in p.engines.values():
        for _ in range(pool_module.FAILURES_TO_EJECT):
            engine.failed()
    assert p.pick_decode().url in p.engines


def test_readmitted_engine_takes_traffic_gradually(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(pool_module.time, "monotonic", lambda: now[0])
    p = pool(2)
    p.engines["http://d0"].readmit(now[0])
    p.engines["http://d1"].outstanding_requests = 4
    assert p.pick_decode().url == "http://d1"            # d0 counts as 8 busy right after re-admission
    now[0] += pool_module.RAMP_S * 0.75
    assert p.pick_decode().url == "http://d0"            # 2 virtual requests < 4 real ones


def test_admission_bounds_turns_and_queued_tokens():
    admission = Admission(max_turns=2, max_queued_tokens=100)
    first = admission.admit(60)
    with pytest.raises(OverloadedError) as err:
        admission.admit(50)
    assert err.value.status == 429 and err.value.headers["Retry-After"]
    first.prefilled()
    second = admission.admit(50)
    with pytest.raises(OverloadedError):
        admission.admit(1)
    first.close()
    first.close()                                        # idempotent
    second.close()
    assert (admission.turns, admission.queued_tokens) == (0, 0)


def test_a_new_conversation_goes_to_the_d_with_free_kv():
    p = pool(2)
    for engine in p.engines.values():
        engine.facts.num_gpu_blocks, engine.facts.block_size = 1000, 16
    p.engines["http://d0"].pinned_blocks = 900          # idle conversations' handles fill d0
    p.engines["http://d0"].outstanding_requests = 0
    p.engines["http://d1"].outstanding_requests = 2             # busier, but its KV is free
    assert {p.pick_decode().url for _ in range(4)} == {"http://d1"}
    p.engines["http://d1"].outstanding_requests = 9             # a queue outweighs free KV
    assert p.pick_decode().url == "http://d0"
    assert p.pick_decode("http://d0").url == "http://d0"        # the holder keeps its conversation regardless


def test_a_new_conversation_goes_to_the_d_whose_own_readings_show_room():
    """D's running requests hold blocks the gateway does not count: D's vllm:kv_cache_usage_perc shows them."""
    from gateway.engines.dataplane import DataPlane
    p = pool(2)
    for engine in p.engines.values():
        engine.facts.num_gpu_blocks, engine.facts.block_size = 1000, 16
    p.engines["http://d0"].observe(DataPlane(kv_cache_usage=0.95, scraped_at=1.0))   # no pins, but full
    p.engines["http://d1"].observe(DataPlane(kv_cache_usage=0.10, scraped_at=1.0))
    p.engines["http://d1"].outstanding_requests = 2
    assert {p.pick_decode().url for _ in range(4)} == {"http://d1"}
    assert p.pick_decode("http://d0").url == "http://d0"        # the holder keeps its conversation


def test_unknown_capacity_routes_on_requests_alone():
    p = pool(2)
    p.engines["http://d0"].pinned_blocks = 900
    p.engines["http://d1"].outstanding_requests = 1
    assert p.pick_decode().url == "http://d0"
