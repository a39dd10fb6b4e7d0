"""KV-event feeds that follow the pools (docs/protocol.md §10): a `KVEventSubscriber` for each engine the
`--kv-events` mapping covers, started when the engine joins (at start, through the admin API, a SIGHUP reload or
DNS discovery: all but the first go through `registry.py`) and stopped when it leaves, its row leaving
`pdgw_kv_events_*` with it. A reload's new mapping is applied to the engines already there.

The mapping's keys are engine URLs, or `dns://NAME:PORT` pool entries standing for every engine found under the
name. An endpoint `tcp://*:PORT` is the engine's own host on that port: where vLLM binds `*`, the gateway connects
to the engine's address, so an engine's own `--kv-events-config` endpoint can be given as it is.

Knowledge is never carried over: an engine that joins gets a fresh `CacheIndex`, UNKNOWN until its first batch as
at start, whatever an earlier subscription to the same URL knew (the engine may have restarted, or missed
nothing, or evicted everything; only its next batch's number can say). One that leaves has its index marked lost,
so a turn still holding its `Engine` trusts nothing stale.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

import zmq.asyncio

from gateway.engines.cache_index import CacheIndex
from gateway.engines.engine import Engine
from gateway.engines.kv_events import KVEventSubscriber
from gateway.engines.pool import EnginePool
from gateway.telemetry import Metrics

log = logging.getLogger("gateway.kv_events")
OWN_HOST = "tcp://*:"


class EventMapping:
    """`--kv-events KEY=ENDPOINT` entries (config.py has checked their shape): where each engine publishes."""

    def __init__(self, entries: Iterable[str] = ()) -> None:
        pairs = (entry.partition("=") for entry in entries)
        self.endpoints = {key.rstrip("/"): endpoint for key, _, endpoint in pairs}

    def endpoint(self, url: str, found_under: Iterable[str] = ()) -> str | None:
        """The engine at `url`'s endpoint: its own entry's, else that of a dns:// entry it was found under."""
        for key in (url, *found_under):
            endpoint = self.endpoints.get(key.rstrip("/"))
            if endpoint is not None:
                return own_host(endpoint, url)
        return None


def own_host(endpoint: str, url: str) -> str:
    """`tcp://*:PORT` → `tcp://HOST:PORT` with the engine's host; any other endpoint as given."""
    if not endpoint.startswith(OWN_HOST):
        return endpoint
    host = urlsplit(url).hostname or ""
    return f"tcp://{f'[{host}]' if ':' in host else host}:{endpoint.removeprefix(OWN_HOST)}"


@dataclass
class Feed:
    engine: Engine
    endpoint: str
    subscriber: KVEventSubscriber
    task: asyncio.Task


class KVEventFeeds:
    """One model's subscribers, by pool role and engine URL; `found_under` names the dns:// entries whose last
    answer holds an engine (discovery.py)."""

    def __init__(self, mapping: EventMapping, metrics: Metrics | None = None,
                 found_under: Callable[[str], Iterable[str]] = lambda url: ()) -> None:
        self.mapping, self._found_under, self._metrics = mapping, found_under, metrics
        self.ctx = zmq.asyncio.Context()
        self._feeds: dict[tuple[str, str], Feed] = {}
        if metrics is not None:
            metrics.kv_events.source.add(self.rows)

    def rows(self) -> list[tuple[str, str, int, str, int]]:
        """Each subscribed engine's state, for `pdgw_kv_events_*`."""
        return [(f.engine.role, f.engine.url, len(f.subscriber.index), f.subscriber.index.knowledge.value,
                 f.subscriber.index.gaps) for f in self._feeds.values()]

    def subscribe_all(self, pools: Iterable[EnginePool]) -> None:
        """Every engine of the pools, as the mapping says now (at start, and after a reload changed it)."""
        for pool in pools:
            for engine in list(pool.engines.values()):
                self.subscribe(engine)

    def remap(self, mapping: EventMapping, pools: Iterable[EnginePool]) -> None:
        """A reloaded mapping: an engine whose endpoint changed subscribes anew, one no longer covered stops."""
        self.mapping = mapping
        self.subscribe_all(pools)

    def subscribe(self, engine: Engine) -> None:
        """An engine of the pools (one that just joined, or any after a remap). Kept where nothing changed."""
        endpoint = self.mapping.endpoint(engine.url, self._found_under(engine.url))
        feed = self._feeds.get((engine.role, engine.url))
        if feed is not None and feed.engine is engine and feed.endpoint == endpoint:
            return
        if feed is not None:
            self.unsubscribe(feed.engine)
            if endpoint is None:
                engine.cache = None            # it publishes nothing the gateway reads now: the lease/TTL rules
        if endpoint is not None:
            self._start(engine, endpoint)

    def unsubscribe(self, engine: Engine) -> None:
        """An engine that left its pool (or whose endpoint changed): its task ends, its row goes."""
        feed = self._feeds.pop((engine.role, engine.url), None)
        if feed is None:
            return
        feed.task.cancel()                     # its sockets close when it has ended (Feed.subscriber.close)
        feed.subscriber.index.lost()
        log.info("KV events of %s: no longer subscribed to %s", engine.url, feed.endpoint)

    async def stop(self) -> None:
        feeds, self._feeds = list(self._feeds.values()), {}
        for feed in feeds:
            feed.task.cancel()
        await asyncio.gather(*(feed.task for feed in feeds), return_exceptions=True)    # a failed one said so
        self.ctx.destroy(linger=0)
        if self._metrics is not None:
            self._metrics.kv_events.source.discard(self.rows)

    def _start(self, engine: Engine, endpoint: str) -> None:
        engine.cache = CacheIndex()            # fresh: UNKNOWN until its first batch
        subscriber = KVEventSubscriber(engine.url, endpoint, engine.cache, self.ctx)
        task = asyncio.create_task(subscriber.run())
        task.add_done_callback(lambda done: _ended(subscriber, done))
        self._feeds[(engine.role, engine.url)] = Feed(engine, endpoint, subscriber, task)
        log.info("KV events of %s: subscribing to %s", engine.url, endpoint)       # the log shows it


def _ended(subscriber: KVEventSubscriber, task: asyncio.Task) -> None:
    """A subscriber's task is over: its sockets close. Over by a failure, its index is trusted no more (knowledge
    left as it was would go on saying complete while the engine's cache changes unheard)."""
    subscriber.close()
    if not task.cancelled() and task.exception() is not None:
        subscriber.index.lost()
        log.error("KV events of %s: the subscriber failed (%r); its cache is unknown from now on", subscriber.url,
                  task.exception())
