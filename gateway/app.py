"""create_app(settings) -> Litestar: routes, error handlers, and the lifespan that owns every resource."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import aiohttp
from litestar import Litestar
from litestar.datastructures import State

from gateway.api.admin import ADMIN_ROUTES
from gateway.api.auth import ApiKeys
from gateway.api.errors import HANDLERS
from gateway.api.routes import ROUTES
from gateway.config import Settings
from gateway.engines.client import EngineClient
from gateway.engines.health import HealthChecker
from gateway.engines.pool import EnginePool
from gateway.engines.registry import EngineRegistry
from gateway.startup import gather as startup_report
from gateway.startup import log_report, open_store
from gateway.store import ConversationStore
from gateway.telemetry import Metrics
from gateway.tracing import Tracing, start_tracing
from gateway.turns.conversations import ConversationAdmin
from gateway.turns.intake import Intake
from gateway.turns.render import Renderer
from gateway.turns.turn import TurnRunner

log = logging.getLogger("gateway")


def create_app(settings: Settings, tracing: Tracing | None = None,
               reload: Callable[[], Settings] | None = None) -> Litestar:
    """`tracing`: defaults to what the settings ask for; tests pass one with an in-memory exporter.
    `reload`: re-reads the configuration on SIGHUP (engines are added and removed; nothing else changes)."""
    if not settings.prefill or not settings.decode:
        raise ValueError("at least one --prefill and one --decode engine are needed")
    tracing = tracing or start_tracing(settings.tracing, settings.otlp_endpoint)
    return Litestar(
        route_handlers=[*ROUTES, *ADMIN_ROUTES],
        exception_handlers=HANDLERS,
        state=State({"api_keys": ApiKeys.from_settings(settings)}),
        middleware=tracing.middleware(),
        lifespan=[lambda app: _lifespan(app, settings, tracing, reload)],
        request_max_body_size=settings.max_body_bytes,
        logging_config=None,         # telemetry.setup_logging owns the root logger (text or JSON)
        openapi_config=None,
        debug=False,
    )


@contextlib.asynccontextmanager
async def _lifespan(app: Litestar, settings: Settings, tracing: Tracing,
                    reload: Callable[[], Settings] | None) -> AsyncIterator[None]:
    state = app.state
    state.settings, state.metrics = settings, Metrics()
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=settings.connect_timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        client = EngineClient(session)
        prefill, decode = EnginePool("prefill", settings.prefill), EnginePool("decode", settings.decode)
        store = open_store(settings)
        health = HealthChecker(client, [prefill, decode], state.metrics, settings.health_interval_s)
        await health.check_all()
        renderer = Renderer(settings.tokenizer, settings.chat_template)
        report = await startup_report(client, prefill, decode, renderer, store, settings)
        log_report(report)
        models, block_size = report.models, report.block_size
        state.intake = Intake(renderer, models, settings.max_messages, settings.history_tokens)
        state.runner = TurnRunner(client=client, prefill=prefill, decode=decode, store=store,
                                  metrics=state.metrics, settings=settings, block_size=block_size,
                                  served_model=models[0] if models else "", tracing=tracing, renderer=renderer)
        state.admin = ConversationAdmin(store, state.runner)
        state.readiness = lambda: _readiness(store, prefill, decode)
        state.registry = EngineRegistry(prefill, decode, health, state.metrics)
        checker = asyncio.create_task(health.run())
        gc.freeze()      # start-up's objects (transformers, jinja, ...) leave the collector's scans for good
        reloading = _reload_on_sighup(state.registry, reload) if reload else contextlib.nullcontext()
        try:
            with reloading:
                yield
        finally:
            checker.cancel()
            await state.runner.drain()
            await store.close()
            tracing.shutdown()


@contextlib.contextmanager
def _reload_on_sighup(registry: EngineRegistry, reload: Callable[[], Settings]) -> Iterator[None]:
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task] = set()

    async def apply() -> None:
        try:
            fresh = reload()
        except (SystemExit, ValueError) as exc:       # a bad file keeps the running configuration
            log.error("configuration reload refused: %s", exc)
            return
        log.warning("configuration reloaded: %s", await registry.sync(fresh.prefill, fresh.decode))

    def on_signal() -> None:
        task = loop.create_task(apply())
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    loop.add_signal_handler(signal.SIGHUP, on_signal)
    try:
        yield
    finally:
        loop.remove_signal_handler(signal.SIGHUP)


async def _readiness(store: ConversationStore, prefill: EnginePool, decode: EnginePool) -> dict[str, Any]:
    try:
        store_ok = await store.ping()
    except Exception:  # any store failure only degrades readiness
        store_ok = False
    engines_ok = bool(prefill.healthy()) and bool(decode.healthy())
    degraded = [] if store_ok else ["store_unavailable: turns are served stateless (plan full)"]
    return {"ready": engines_ok, "store": store.kind, "store_ok": store_ok, "degraded": degraded,
            "prefill_healthy": len(prefill.healthy()), "decode_healthy": len(decode.healthy())}
