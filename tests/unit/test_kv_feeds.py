"""KV-event feeds following the pools (engines/kv_feeds.py): which endpoint an engine's events are read from (its
own entry, a dns:// entry it was found under, `*` as its own host), and subscribers started and stopped as engines
join and leave through the registry (admin API, reload), DNS discovery or a reloaded mapping. Sockets are real but
connect to nothing: what is checked is who is subscribed where, and what each index then knows."""

from __future__ import annotations

import asyncio

import pytest

from gateway.engines.cache_index import Knowledge
from gateway.engines.discovery import EngineDiscovery
from gateway.engines.kv_feeds import EventMapping, KVEventFeeds
from gateway.engines.pool import EnginePool
from gateway.engines.registry import EngineRegistry
from gateway.telemetry import Metrics
from tests.unit.test_discovery import NAME, NoProbes, ScriptedResolver, addresses

D0, D1 = "http://127.0.0.1:8200", "http://127.0.0.2:8200"


@pytest.mark.parametrize(("url", "found_under", "entries", "endpoint"), [
    (D0, [], [f"{D0}=tcp://10.9.9.9:5557"], "tcp://10.9.9.9:5557"),           # as given
    (D0, [], [f"{D0}/=ipc:///run/d0.sock"], "ipc:///run/d0.sock"),
    (D0, [], [f"{D0}=tcp://*:5557"], "tcp://127.0.0.1:5557"),                 # `*`: the engine's own host
    ("http://[::1]:8200", [], ["http://[::1]:8200=tcp://*:5557"], "tcp://[::1]:5557"),
    ("http://10.0.3.7:8200", [NAME], [f"{NAME}=tcp://*:5557"], "tcp://10.0.3.7:5557"),   # found under the name
    ("http://10.0.3.7:8200", [NAME + "/"], [f"{NAME}=tcp://*:5557"], "tcp://10.0.3.7:5557"),
    ("http://10.0.3.7:8200", [NAME], [f"{NAME}=tcp://*:5557", "http://10.0.3.7:8200=tcp://*:6000"],
     "tcp://10.0.3.7:6000"),                                                  # its own entry first
    ("http://10.0.3.7:8200", [], [f"{NAME}=tcp://*:5557"], None),             # not (or no longer) found under it
    (D1, [], [f"{D0}=tcp://*:5557"], None),
])
def test_an_engine_s_endpoint(url, found_under, entries, endpoint):
    assert EventMapping(entries).endpoint(url, found_under) == endpoint


def kv_rows(metrics: Metrics) -> set[tuple[str, str]]:
    """The (pool, engine) rows of pdgw_kv_events_cached_blocks as a scrape would show them."""
    (blocks, *_) = metrics.kv_events.collect()
    return {(s.labels["pool"], s.labels["engine"]) for s in blocks.samples}


async def registry_with_feeds(entries: list[str], decode: list[str]) -> tuple[EngineRegistry, KVEventFeeds,
                                                                              Metrics]:
    metrics = Metrics()
    prefill, pool = EnginePool("prefill", ["http://p0:8100"]), EnginePool("decode", decode)
    feeds = KVEventFeeds(EventMapping(entries), metrics)
    feeds.subscribe_all([prefill, pool])
    return EngineRegistry(prefill, pool, NoProbes(), metrics, feeds), feeds, metrics


async def test_an_engine_that_leaves_loses_its_feed_and_one_that_rejoins_starts_fresh():
    registry, feeds, metrics = await registry_with_feeds([f"{D0}=tcp://*:5557", f"{D1}=tcp://*:5558"], [D0])
    try:
        first = registry.pools["decode"].engines[D0]
        first.cache.apply(0, [])                   # its first batch: everything since its start is known
        assert first.known_cache is first.cache and kv_rows(metrics) == {("decode", D0)}
        subscriber = feeds._feeds[("decode", D0)].subscriber
        assert registry.remove("decode", D0)
        assert kv_rows(metrics) == set() and feeds.rows() == []
        assert first.known_cache is None           # a turn still holding it trusts nothing stale
        await asyncio.sleep(0.01)
        assert subscriber.sock.closed              # its task ended and its sockets with it
        again = await registry.add("decode", D0)
        assert again is not first and again.cache is not first.cache
        assert (again.cache.knowledge, len(again.cache), again.cache.last_seq) == (Knowledge.UNKNOWN, 0, None)
        await registry.add("decode", D1)           # joins with its own endpoint; one not in the mapping gets none
        await registry.add("decode", "http://127.0.0.3:8200")
        assert {(r[1], feeds._feeds[("decode", r[1])].endpoint) for r in feeds.rows()} == {
            (D0, "tcp://127.0.0.1:5557"), (D1, "tcp://127.0.0.2:5558")}
        assert registry.pools["decode"].engines["http://127.0.0.3:8200"].cache is None
    finally:
        await feeds.stop()
    assert kv_rows(metrics) == set()


async def test_engines_found_under_a_dns_name_follow_its_answers():
    discovery = EngineDiscovery(ScriptedResolver({"pdgw-decode.ns.svc": [
        addresses("10.0.0.1"), addresses("10.0.0.1", "10.0.0.2"), addresses("10.0.0.2")]}), interval_s=0.0)
    await discovery.follow(["http://p0:8100"], [NAME])
    prefill, decode = discovery.pool("prefill", {}), discovery.pool("decode", {})
    metrics = Metrics()
    feeds = KVEventFeeds(EventMapping([f"{NAME}=tcp://*:5557"]), metrics, discovery.found_under)
    feeds.subscribe_all([prefill, decode])
    registry = EngineRegistry(prefill, decode, NoProbes(), metrics, feeds)
    subscribed = lambda: {url: feeds._feeds[("decode", url)].endpoint for _, url, *_ in feeds.rows()}  # noqa: E731
    try:
        assert subscribed() == {"http://10.0.0.1:8200": "tcp://10.0.0.1:5557"}
        for now in ({"10.0.0.1", "10.0.0.2"}, {"10.0.0.2"}):
            before = {role: set(discovery.wanted(role)) for role in ("prefill", "decode")}
            await discovery._look(list(discovery.followed.values()))
            await discovery._apply(registry, before)
            assert subscribed() == {f"http://{ip}:8200": f"tcp://{ip}:5557" for ip in now}
        assert kv_rows(metrics) == {("decode", "http://10.0.0.2:8200")}
    finally:
        await feeds.stop()


async def test_a_reloaded_mapping_applies_to_the_engines_already_there():
    registry, feeds, metrics = await registry_with_feeds([], [D0, D1])
    pools = registry.pools.values()
    try:
        assert feeds.rows() == [] and registry.pools["decode"].engines[D0].cache is None
        feeds.remap(EventMapping([f"{D0}=tcp://*:5557", f"{D1}=tcp://*:5557"]), pools)
        d0, d1 = (registry.pools["decode"].engines[url] for url in (D0, D1))
        kept = d1.cache
        d0.cache.apply(0, [])
        feeds.remap(EventMapping([f"{D0}=tcp://*:6000", f"{D1}=tcp://*:5557"]), pools)     # D0's endpoint moves
        assert d0.cache.knowledge is Knowledge.UNKNOWN and feeds._feeds[("decode", D0)].endpoint.endswith(":6000")
        assert d1.cache is kept                    # nothing changed for D1: its feed and knowledge stay
        feeds.remap(EventMapping([f"{D1}=tcp://*:5557"]), pools)                            # D0 no longer covered
        assert d0.cache is None and kv_rows(metrics) == {("decode", D1)}
    finally:
        await feeds.stop()


async def test_a_subscriber_that_fails_leaves_its_engine_s_cache_unknown(monkeypatch):
    registry, feeds, _ = await registry_with_feeds([f"{D0}=tcp://*:5557"], [D0])
    engine = registry.pools["decode"].engines[D0]
    engine.cache.apply(0, [])
    subscriber = feeds._feeds[("decode", D0)].subscriber

    async def broken() -> None:
        raise RuntimeError("socket gone")

    monkeypatch.setattr(subscriber.sock, "recv_multipart", broken)
    try:
        await asyncio.sleep(0.01)
        assert engine.known_cache is None and subscriber.sock.closed      # not complete forever, unheard
    finally:
        await feeds.stop()
