"""create_app(settings) -> Litestar: routes, error handlers, and the lifespan that owns every resource."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
from litestar import Litestar

from gateway.api.admin import ADMIN_ROUTES
from gateway.api.errors import HANDLERS
from gateway.api.routes import ROUTES
from gateway.config import DEFAULT_TENANT, Settings
from gateway.engines.client import EngineClient
from gateway.engines.health import HealthChecker
from gateway.engines.pool import EnginePool
from gateway.engines.probe import probe
from gateway.store import ConversationStore, MemoryConversationStore, RedisConversationStore
from gateway.telemetry import Metrics
from gateway.turns.conversations import ConversationAdmin
from gateway.turns.intake import Intake
from gateway.turns.render import Renderer
from gateway.turns.turn import TurnRunner

log = logging.getLogger("gateway")
DEFAULT_BLOCK_SIZE = 16


def create_app(settings: Settings) -> Litestar:
    if not settings.prefill or not settings.decode:
        raise ValueError("at least one --prefill and one --decode engine are needed")
    return Litestar(
        route_handlers=[*ROUTES, *ADMIN_ROUTES],
        exception_handlers=HANDLERS,
        lifespan=[lambda app: _lifespan(app, settings)],
        request_max_body_size=settings.max_body_bytes,
        openapi_config=None,
        debug=False,
    )


@contextlib.asynccontextmanager
async def _lifespan(app: Litestar, settings: Settings) -> AsyncIterator[None]:
    state = app.state
    state.settings, state.tenant, state.metrics = settings, DEFAULT_TENANT, Metrics()
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=settings.connect_timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        client = EngineClient(session)
        prefill, decode = EnginePool("prefill", settings.prefill), EnginePool("decode", settings.decode)
        store = _store(settings)
        health = HealthChecker(client, [prefill, decode], state.metrics, settings.health_interval_s)
        await health.check_all()
        models, block_size = await _discover(client, prefill, decode, settings)
        state.intake = Intake(Renderer(settings.tokenizer, settings.chat_template), models)
        state.runner = TurnRunner(client=client, prefill=prefill, decode=decode, store=store,
                                  metrics=state.metrics, settings=settings, block_size=block_size,
                                  served_model=models[0] if models else "")
        state.admin = ConversationAdmin(store, state.runner)
        state.readiness = lambda: _readiness(store, prefill, decode)
        log.info("pd-gateway: %d prefill, %d decode engines; store %s; block size %d; models %s",
                 len(prefill.engines), len(decode.engines), store.kind, block_size, models)
        checker = asyncio.create_task(health.run())
        try:
            yield
        finally:
            checker.cancel()
            await state.runner.drain()
            await store.close()


def _store(settings: Settings) -> ConversationStore:
    if settings.redis_url:
        return RedisConversationStore.from_url(settings.redis_url, conversation_ttl_s=settings.conversation_ttl_s)
    log.info("conversation store: embedded (single process); pass --redis-url to share state between replicas")
    return MemoryConversationStore(conversation_ttl_s=settings.conversation_ttl_s)


async def _discover(client: EngineClient, prefill: EnginePool, decode: EnginePool,
                    settings: Settings) -> tuple[list[str], int]:
    engines = [*prefill.engines.values(), *decode.engines.values()]
    infos = await asyncio.gather(*(probe(client, e) for e in engines))
    models = [settings.model] if settings.model else next((i["models"] for i in infos if i.get("models")), [])
    sizes = {i["block_size"] for i in infos if "block_size" in i}
    if len(sizes) > 1:
        log.error("engines disagree on KV block size %s: bidirectional transfer needs equal sizes", sizes)
    block_size = settings.block_size or (min(sizes) if sizes else DEFAULT_BLOCK_SIZE)
    if not settings.block_size and not sizes:
        log.warning("no engine reported its KV block size; assuming %d", block_size)
    return models, block_size


async def _readiness(store: ConversationStore, prefill: EnginePool, decode: EnginePool) -> dict[str, Any]:
    try:
        store_ok = await store.ping()
    except Exception:  # any store failure only degrades readiness
        store_ok = False
    engines_ok = bool(prefill.healthy()) and bool(decode.healthy())
    degraded = [] if store_ok else ["store_unavailable: turns are served stateless (plan full)"]
    return {"ready": engines_ok, "store": store.kind, "store_ok": store_ok, "degraded": degraded,
            "prefill_healthy": len(prefill.healthy()), "decode_healthy": len(decode.healthy())}
