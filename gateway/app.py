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
from litestar.di import Provide

from gateway.api.admin import ADMIN_ROUTES
from gateway.api.auth import ApiKeys
from gateway.api.operational import metrics_listener
from gateway.api.error_shapes import HANDLERS
from gateway.api.messages_routes import MESSAGES_ROUTES
from gateway.api.responses_routes import RESPONSES_ROUTES
from gateway.api.routes import ROUTES
from gateway.api.turn_entry import Gateway
from gateway.assembly import ModelSet, ModelStack
from gateway.config import Settings
from gateway.engines.client import EngineClient, engine_connector
from gateway.store import ConversationStore, open_store
from gateway.telemetry import Metrics
from gateway.tracing import Tracing, start_tracing
from gateway.turns.run.admission import Admission
from gateway.turns.state.stored_responses import StoredResponses

# What handlers are given, by parameter name: resources the lifespan builds and keeps in the app's state.
_PROVIDED = ("gateway", "settings", "metrics", "api_keys", "readiness")

log = logging.getLogger("gateway")


def create_app(settings: Settings, tracing: Tracing | None = None,
               reload: Callable[[], Settings] | None = None) -> Litestar:
    """`tracing`: defaults to what the settings ask for; tests pass one with an in-memory exporter.
    `reload`: re-reads the configuration on SIGHUP (engines are added and removed; nothing else changes)."""
    if not all(s.settings.prefill and s.settings.decode for s in settings.deployment()):
        raise ValueError("at least one --prefill and one --decode engine are needed")
    tracing = tracing or start_tracing(settings.tracing, settings.otlp_endpoint)
    return Litestar(
        route_handlers=[*ROUTES, *RESPONSES_ROUTES, *MESSAGES_ROUTES, *ADMIN_ROUTES],
        exception_handlers=HANDLERS,
        state=State({"api_keys": ApiKeys.from_settings(settings), "settings": settings}),
        dependencies={name: Provide(_from_state(name), sync_to_thread=False) for name in _PROVIDED},
        middleware=[metrics_listener(settings.metrics_port), *tracing.middleware()],
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
    state.metrics = Metrics()
    connector = engine_connector()
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=settings.connect_timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        client = EngineClient(session)
        store = open_store(settings.redis_url, settings.conversation_ttl_s)
        admission = Admission(settings.max_concurrent_turns, settings.max_queued_prompt_tokens)    # the process's
        models = ModelSet(client, store, state.metrics, tracing, admission)
        try:
            await models.start(settings.deployment())
            state.gateway = Gateway(state.api_keys, state.metrics, settings, models.routes,
                                    StoredResponses(store, state.metrics))
            models.on_change = state.gateway.set_routes
            state.readiness = lambda: _readiness(store, models.stacks)
            gc.freeze()      # start-up's objects (transformers, jinja, ...) leave the collector's scans for good
            reloading = _reload_on_sighup(models, reload) if reload else contextlib.nullcontext()
            with reloading:
                yield
        finally:
            await models.stop()
            await store.close()
            tracing.shutdown()


def _from_state(name: str) -> Callable[[State], Any]:
    def provide(state: State) -> Any:
        return state[name]
    return provide


@contextlib.contextmanager
def _reload_on_sighup(models: ModelSet, reload: Callable[[], Settings]) -> Iterator[None]:
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task] = set()

    async def apply() -> None:
        try:
            said = await models.reload(reload().deployment())
        except (SystemExit, Exception) as exc:        # a bad file keeps the running configuration
            log.error("configuration reload refused: %s", exc)
            return
        log.warning("configuration reloaded: %s", "; ".join(said))

    def on_signal() -> None:
        task = loop.create_task(apply())
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    loop.add_signal_handler(signal.SIGHUP, on_signal)
    try:
        yield
    finally:
        loop.remove_signal_handler(signal.SIGHUP)


async def _readiness(store: ConversationStore, stacks: list[ModelStack]) -> dict[str, Any]:
    try:
        store_ok = await store.ping()
    except Exception:  # any store failure only degrades readiness
        store_ok = False
    engines_ok = all(s.prefill.healthy() and s.decode.healthy() for s in stacks)    # every model can serve
    degraded = [] if store_ok else ["store_unavailable: turns are served stateless (plan full)"]
    store_name = "embedded" if store.kind == "memory" else store.kind      # as the report and the docs say
    # Open to anyone (load balancers, orchestrators): it says nothing of the engines beyond `ready`.
    return {"ready": engines_ok, "store": store_name, "store_ok": store_ok, "degraded": degraded}
