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
from gateway.config import Settings, engine_names
from gateway.engines.client import EngineClient
from gateway.engines.health import HealthChecker
from gateway.engines.kv_events import KVEventFeeds, parse_mapping
from gateway.engines.pool import EnginePool
from gateway.engines.registry import EngineRegistry
from gateway.engines.transfer import Mode, PushIdentities, TransferModeError
from gateway.startup import gather as startup_report
from gateway.startup import PinnedIdsProof, log_report
from gateway.store import ConversationStore, open_store
from gateway.telemetry import Metrics
from gateway.tracing import Tracing, start_tracing
from gateway.turns.legs.calibration import PROBE_TEXT, RateProbe
from gateway.turns.legs.calls import EngineCalls
from gateway.turns.admin_actions import ConversationAdmin, EngineAdmin
from gateway.turns.intake.continued import Continuation
from gateway.turns.intake.intake import Intake
from gateway.turns.legs.release import HandleReleaser
from gateway.turns.intake.render import Renderer
from gateway.turns.state.budget import PinBudget
from gateway.turns.state.earning import PinEarnings
from gateway.turns.state.pins import PinLedger
from gateway.turns.state.replicas import ReplicaShare
from gateway.turns.state.stored_responses import StoredResponses
from gateway.turns.state.state import ConversationState
from gateway.turns.runner import TurnRunner

# What handlers are given, by parameter name: resources the lifespan builds and keeps in the app's state.
_PROVIDED = ("gateway", "settings", "metrics", "intake", "api_keys", "conversations", "fleet", "readiness")

log = logging.getLogger("gateway")
PROBE_STARTUP_WAIT_S = 20.0


def create_app(settings: Settings, tracing: Tracing | None = None,
               reload: Callable[[], Settings] | None = None) -> Litestar:
    """`tracing`: defaults to what the settings ask for; tests pass one with an in-memory exporter.
    `reload`: re-reads the configuration on SIGHUP (engines are added and removed; nothing else changes)."""
    if not settings.prefill or not settings.decode:
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
    connector = aiohttp.TCPConnector(limit=0, ttl_dns_cache=300)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=settings.connect_timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        client = EngineClient(session)
        names = engine_names(settings)
        prefill, decode = EnginePool("prefill", settings.prefill, names), EnginePool("decode", settings.decode, names)
        store = open_store(settings.redis_url, settings.conversation_ttl_s)
        health = HealthChecker(client, [prefill, decode], state.metrics, settings.health_interval_s)
        feeds = KVEventFeeds(parse_mapping(settings.kv_events), [prefill, decode], state.metrics)
        feeds.start()                        # before the first turn: a publisher's seq 0 then says "complete"
        await health.check_all()
        renderer = Renderer(settings.tokenizer, settings.chat_template)
        report = await startup_report(client, prefill, decode, renderer, store, settings)
        log_report(report)
        if report.transfer.refusal:          # a mixed pool cannot pair: say so once and do not start
            log.error("pd-gateway refuses to start: %s", report.transfer.refusal)
            raise TransferModeError(report.transfer.refusal)
        health.on_readmit.append(PinnedIdsProof(client, renderer, settings.model).engine_back)
        models, block_size = report.models, report.block_size
        if report.transfer.push:             # a P back may be a restarted one with a new identity
            health.on_readmit.append(PushIdentities(client, decode, settings.model, block_size).engine_back)
        state.intake = Intake(renderer, models, settings.max_messages, settings.history_tokens,
                              report.max_model_len)
        runner = _runner(client, prefill, decode, store, state.metrics, settings, block_size,
                         models[0] if models else "", tracing, renderer, report.transfer.mode)
        state.gateway = Gateway(state.api_keys, state.intake, state.metrics, runner, settings,
                                StoredResponses(store, state.metrics), Continuation(state.intake))
        state.conversations = ConversationAdmin(store, runner.releaser, runner.state.pins)
        state.readiness = lambda: _readiness(store, prefill, decode)
        registry = EngineRegistry(prefill, decode, health, state.metrics)
        state.fleet = EngineAdmin(prefill, decode, registry, runner.state.pins)
        checker = asyncio.create_task(health.run())
        ledger = runner.state.pins.pins
        sharing = asyncio.create_task(ReplicaShare(store, ledger.budget).run()) if ledger is not None else None
        probing = await _calibrated(runner, prefill, decode, renderer, health, state.metrics, settings,
                                    models[0] if models else "")
        gc.freeze()      # start-up's objects (transformers, jinja, ...) leave the collector's scans for good
        reloading = _reload_on_sighup(registry, reload) if reload else contextlib.nullcontext()
        try:
            with reloading:
                yield
        finally:
            checker.cancel()
            await feeds.stop()
            if sharing is not None:
                sharing.cancel()
            if probing is not None:
                probing.cancel()
            await runner.drain()
            await store.close()
            tracing.shutdown()


def _from_state(name: str) -> Callable[[State], Any]:
    def provide(state: State) -> Any:
        return state[name]
    return provide


def _runner(client: EngineClient, prefill: EnginePool, decode: EnginePool, store: ConversationStore,
            metrics: Metrics, settings: Settings, block_size: int, model: str, tracing: Tracing,
            renderer: Renderer, transfer_mode: Mode = "pull") -> TurnRunner:
    """The turn machinery: engine calls, the handle releaser and the conversation state, shared by every turn."""
    calls = EngineCalls(metrics)
    releaser = HandleReleaser(client, prefill, calls, metrics, model)
    earnings = PinEarnings(settings.decode_pin_budget, settings.handle_ttl_s, settings.decode_pin_policy == "adaptive")
    pins = PinLedger(PinBudget(settings.decode_pin_budget, block_size), earnings) if block_size else None
    state = ConversationState(store=store, decode=decode, releaser=releaser, metrics=metrics, settings=settings,
                              block_size=block_size, renderer=renderer, pins=pins)
    return TurnRunner(client=client, prefill=prefill, decode=decode, state=state, calls=calls, releaser=releaser,
                      metrics=metrics, settings=settings, tracing=tracing, transfer_mode=transfer_mode)


async def _calibrated(runner: TurnRunner, prefill: EnginePool, decode: EnginePool, renderer: Renderer,
                      health: HealthChecker, metrics: Metrics, settings: Settings, model: str) -> asyncio.Task | None:
    """Under the cost plan, the rates it weighs: probed per P-D pair before serving (at most a few seconds'
    wait), then kept fresh in the background. None when there is nothing to calibrate."""
    metrics.learned_rates.source = runner.rates.known
    if settings.reuse_policy != "cost" or not settings.rate_probe_tokens or not runner.transfer.reads_d_kv:
        return None              # push mode has no read of D's KV to calibrate (docs/protocol.md §8)
    probe = RateProbe(client=runner.client, calls=runner.calls, prefill=prefill, decode=decode, rates=runner.rates,
                      releaser=runner.releaser, vocabulary=renderer.encode(PROBE_TEXT), model=model,
                      settings=settings)
    health.on_readmit.append(probe.engine_back)
    task = asyncio.create_task(probe.run())
    await probe.wait_first_pass(PROBE_STARTUP_WAIT_S)
    return task


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
        for pool in registry.pools.values():      # engines joining now get the names the reloaded file gives
            pool.names.update(engine_names(fresh))
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
    store_name = "embedded" if store.kind == "memory" else store.kind      # as the report and the docs say
    # Open to anyone (load balancers, orchestrators): it says nothing of the engines beyond `ready`.
    return {"ready": engines_ok, "store": store_name, "store_ok": store_ok, "degraded": degraded}
