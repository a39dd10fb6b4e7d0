"""One model's part of a gateway, assembled (issue 39): its P and D pools, their health checks and KV-event feeds,
its tokenizer and chat template, the start-up report, the turn machinery (runner, pin budget, calibration), and
its engine registry. app.py builds one per model of the deployment, sharing the HTTP session, the store and the
metrics; the API routes a request to one by its `model` (api/turn_entry.py)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.api.turn_entry import ModelRoute
from gateway.config import ModelSetup, Settings, engine_names, model_label
from gateway.engines.client import EngineClient
from gateway.engines.discovery import DnsResolver, EngineDiscovery
from gateway.engines.health import HealthChecker
from gateway.engines.kv_feeds import EventMapping, KVEventFeeds
from gateway.engines.pool import EnginePool
from gateway.engines.registry import EngineRegistry
from gateway.engines.transfer import Mode, PushIdentities, TransferModeError
from gateway.startup import PinnedIdsProof, log_report
from gateway.startup import gather as startup_report
from gateway.store import ConversationStore
from gateway.telemetry import Metrics
from gateway.tracing import Tracing
from gateway.turns.admin_actions import ConversationAdmin, EngineAdmin
from gateway.turns.intake.continued import Continuation
from gateway.turns.intake.intake import Intake
from gateway.turns.intake.render import Renderer
from gateway.turns.legs.calibration import PROBE_TEXT, RateProbe
from gateway.turns.legs.calls import EngineCalls
from gateway.turns.legs.release import HandleReleaser
from gateway.turns.run.admission import Admission
from gateway.turns.runner import TurnRunner
from gateway.turns.state.budget import PinBudget
from gateway.turns.state.earning import PinEarnings
from gateway.turns.state.pins import PinLedger
from gateway.turns.state.replicas import ReplicaShare
from gateway.turns.state.state import ConversationState

log = logging.getLogger("gateway")
PROBE_STARTUP_WAIT_S = 20.0


@dataclass
class ModelStack:
    setup: ModelSetup
    prefill: EnginePool
    decode: EnginePool
    health: HealthChecker
    feeds: KVEventFeeds
    runner: TurnRunner
    route: ModelRoute
    registry: EngineRegistry
    discovery: EngineDiscovery
    tasks: list[asyncio.Task] = field(default_factory=list)

    @property
    def name(self) -> str | None:
        return self.setup.settings.model

    async def stop(self) -> None:
        """Its loops end and what its turns left running finishes; its engines and rates leave /metrics."""
        for task in self.tasks:
            task.cancel()
        await self.feeds.stop()
        self.health.close()
        self.runner.metrics.learned_rates.source.discard(self.runner.rates.known)
        await self.runner.drain()


class ModelSet:
    """The models served now and what they share (HTTP session, store, metrics, the process's admission):
    started together, changed by a reload (models added and taken out, each one's engines synced), stopped
    together. `on_change` gets the routes after each change (the API's `Gateway.set_routes`)."""

    def __init__(self, client: EngineClient, store: ConversationStore, metrics: Metrics, tracing: Tracing,
                 admission: Admission) -> None:
        self.client, self.store, self.metrics, self.tracing, self.admission = client, store, metrics, tracing, admission
        self.stacks: list[ModelStack] = []
        self.on_change: Callable[[list[ModelRoute]], None] = lambda routes: None

    @property
    def routes(self) -> list[ModelRoute]:
        return [s.route for s in self.stacks]

    async def start(self, setups: list[ModelSetup]) -> None:
        for setup in setups:             # one after the other: each logs its own start-up report
            self.stacks.append(await self._build(setup, several=len(setups) > 1))

    async def reload(self, fresh: list[ModelSetup]) -> list[str]:
        """Models named now and not served start; models served and no longer named stop (their turns in
        flight finish first: only new requests stop finding them); the others' engines are synced."""
        if not all(s.settings.prefill and s.settings.decode for s in fresh):
            raise ValueError("every model needs at least one prefill and one decode engine")
        named = {s.settings.model: s for s in fresh}
        said = []
        for stack in [s for s in self.stacks if s.name not in named]:
            self.stacks.remove(stack)
            self.on_change(self.routes)
            await stack.stop()
            await stack.registry.sync([], [])           # its engines leave the pools and pdgw_engine_healthy
            said.append(f"model {stack.name} taken out")
        for stack in self.stacks:
            now = named[stack.name].settings
            for pool in stack.registry.pools.values():      # engines joining now get the names the file gives
                pool.names.update(engine_names(now))
            stack.feeds.remap(EventMapping(now.kv_events), stack.registry.pools.values())   # and its kv_events
            changes = await stack.discovery.reload(stack.registry, now.prefill, now.decode)
            said.append(f"{stack.name or 'engines'}: {changes}")
        for setup in (s for name, s in named.items() if name not in {st.name for st in self.stacks}):
            self.stacks.append(await self._build(setup, several=True))
            self.on_change(self.routes)
            said.append(f"model {setup.settings.model} added")
        return said

    async def stop(self) -> None:
        for stack in self.stacks:
            await stack.stop()

    async def _build(self, setup: ModelSetup, several: bool) -> ModelStack:
        name = setup.settings.model
        label = model_label(name) + "." if several and name else ""
        return await build(setup, self.client, self.store, self.metrics, self.tracing, self.admission, label)


async def build(setup: ModelSetup, client: EngineClient, store: ConversationStore, metrics: Metrics,
                tracing: Tracing, admission: Admission, label: str = "") -> ModelStack:
    """Start one model's part: engines checked, the report logged, the runner ready. `label` prefixes its engines'
    default names in metrics where several models are served (their pools would otherwise both say prefill-0)."""
    settings = setup.settings
    names = engine_names(settings)
    discovery = EngineDiscovery(DnsResolver(settings.discovery_nameserver), settings.discovery_interval_s)
    await discovery.follow(settings.prefill, settings.decode)      # dns:// entries' first answers
    prefill, decode = discovery.pool("prefill", names, label), discovery.pool("decode", names, label)
    health = HealthChecker(client, [prefill, decode], metrics, settings.health_interval_s)
    feeds = KVEventFeeds(EventMapping(settings.kv_events), metrics, discovery.found_under)
    feeds.subscribe_all([prefill, decode])   # before the first turn: a publisher's seq 0 then says "complete"
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
    intake = Intake(renderer, models, settings.max_messages, settings.history_tokens, report.max_model_len,
                    aliases=setup.aliases)
    served = models[0] if models else ""
    metrics = metrics.for_model(served)       # its turns' families labelled with its name
    runner = _runner(client, prefill, decode, store, metrics, settings, block_size, served, tracing, renderer,
                     report.transfer.mode, admission)
    registry = EngineRegistry(prefill, decode, health, metrics, feeds)     # engines joining later: their feeds
    route = ModelRoute(intake, runner, Continuation(intake), ConversationAdmin(store, runner.releaser,
                       runner.state.pins), EngineAdmin(prefill, decode, registry, runner.state.pins),
                       scope=setup.scope, aliases=setup.aliases)
    stack = ModelStack(setup, prefill, decode, health, feeds, runner, route, registry, discovery)
    stack.tasks.append(asyncio.create_task(health.run()))
    stack.tasks.append(asyncio.create_task(discovery.run(registry)))
    if (ledger := runner.state.pins.pins) is not None:
        stack.tasks.append(asyncio.create_task(ReplicaShare(store, ledger.budget).run()))
    if (probing := await _calibrated(runner, prefill, decode, renderer, health, metrics, settings, served)):
        stack.tasks.append(probing)
    return stack


def _runner(client: EngineClient, prefill: EnginePool, decode: EnginePool, store: ConversationStore,
            metrics: Metrics, settings: Settings, block_size: int, model: str, tracing: Tracing,
            renderer: Renderer, transfer_mode: Mode = "pull", admission: Admission | None = None) -> TurnRunner:
    """The turn machinery: engine calls, the handle releaser and the conversation state, shared by every turn."""
    calls = EngineCalls(metrics)
    releaser = HandleReleaser(client, prefill, calls, metrics, model)
    earnings = PinEarnings(settings.decode_pin_budget, settings.handle_ttl_s, settings.decode_pin_policy == "adaptive")
    pins = PinLedger(PinBudget(settings.decode_pin_budget, block_size), earnings) if block_size else None
    state = ConversationState(store=store, decode=decode, releaser=releaser, metrics=metrics, settings=settings,
                              block_size=block_size, renderer=renderer, pins=pins)
    return TurnRunner(client=client, prefill=prefill, decode=decode, state=state, calls=calls, releaser=releaser,
                      metrics=metrics, settings=settings, tracing=tracing, transfer_mode=transfer_mode,
                      admission=admission)


async def _calibrated(runner: TurnRunner, prefill: EnginePool, decode: EnginePool, renderer: Renderer,
                      health: HealthChecker, metrics: Metrics, settings: Settings, model: str) -> asyncio.Task | None:
    """Under the cost plan, the rates it weighs: probed per P-D pair before serving (at most a few seconds'
    wait), then kept fresh in the background. None when there is nothing to calibrate."""
    metrics.learned_rates.source.add(runner.rates.known)
    if settings.reuse_policy != "cost" or not settings.rate_probe_tokens or not runner.transfer.reads_d_kv:
        return None              # push mode has no read of D's KV to calibrate (docs/protocol.md §8)
    probe = RateProbe(client=runner.client, calls=runner.calls, prefill=prefill, decode=decode, rates=runner.rates,
                      releaser=runner.releaser, vocabulary=renderer.encode(PROBE_TEXT), model=model,
                      settings=settings)
    health.on_readmit.append(probe.engine_back)
    task = asyncio.create_task(probe.run())
    await probe.wait_first_pass(PROBE_STARTUP_WAIT_S)
    return task
