"""The start-up report: which engines answered, their vLLM versions and KV block sizes, bidirectional transfer,
template parity, the store, and what all that means for reuse. Logged by the app at start; printed by
`pd-gateway check`, which exits non-zero when the verdict is `fail`.

Pinned prompt ids: each engine (P and D) is asked for one token with `kv_transfer_params.prompt_token_ids` set to
the rendering of another conversation than its messages; an engine whose echoed prompt is the pinned one uses the
gateway's verified ids by construction, so its P legs need not echo their prompt for a parity check
(turns/run/prefill_leg.py), and neither leg need carry the history's text: only the last message
(turns/legs/bodies.py, docs/protocol.md §5.1). The proof is dropped when an engine leaves and re-run when it comes
back healthy (`PinnedIdsProof.engine_back`).

Template parity: the gateway renders a fixed conversation with its tokenizer and chat template and compares
the ids with each engine's `POST /tokenize` (messages form). Any difference means the gateway verifies
continuity on other tokens than the engine's model was trained to see.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import asdict, dataclass
from typing import Any, Literal

import aiohttp

from gateway import startup_findings as findings
from gateway.config import Settings, mask_url
from gateway.engines.client import EngineClient
from gateway.engines.discovery import resolved
from gateway.engines.engine import Engine
from gateway.engines.pool import EnginePool
from gateway.engines.probe import PROBE_TIMEOUT_S, honours_pinned_ids, probe, tokenize_chat
from gateway.engines.transfer import (ModeVerdict, PushIdentities, Seen, decide, describe, mode_of,
                                      preflight, push_target)
from gateway.errors import GatewayError
from gateway.startup_findings import DEFAULT_BLOCK_SIZE, EngineReport, Finding, Level
from gateway.store import ConversationStore, open_store
from gateway.turns.intake.render import Renderer

log = logging.getLogger("gateway.startup")
# User / assistant / user: accepted by templates that reject system messages or demand strict alternation.
PROBE_MESSAGES = [
    {"role": "user", "content": "Hello! What is 2 + 2?"},
    {"role": "assistant", "content": "2 + 2 = 4. Anything else?"},
    {"role": "user", "content": "Yes: name three prime numbers, please."},
]
# The pinned-ids probe's ids: the rendering of this conversation, sent with PROBE_MESSAGES (same roles, so every
# template accepts both), so that an engine that renders the messages echoes other ids than the pinned ones.
PINNED_PROBE_MESSAGES = [*PROBE_MESSAGES[:2], {"role": "user", "content": "No, thank you: that was all."}]
_RANK = {"ok": 0, "warn": 1, "fail": 2}


@dataclass
class StartupReport:
    engines: list[EngineReport]
    store: str                                    # "embedded" or the Redis URL, password masked
    store_ok: bool
    models: list[str]
    block_size: int
    max_model_len: int | None                     # the smallest any engine reported: longer requests get 400
    reuse: str                                    # one sentence: what this set-up means for reuse
    findings: list[Finding]
    transfer: ModeVerdict = ModeVerdict("pull")   # pull or push (docs/protocol.md §8.5); a refusal stops serve

    @property
    def verdict(self) -> Level:
        return max((f.level for f in self.findings), key=_RANK.__getitem__, default="ok")

    def lines(self) -> list[str]:
        store = f"{self.store} ({'answers' if self.store_ok else 'does not answer'})"
        return ["pd-gateway start-up report", *(f"  {e.line()}" for e in self.engines),
                f"  store    {store}", f"  models   {', '.join(self.models) or '?'}; KV block size {self.block_size}; "
                f"max_model_len {self.max_model_len or '?'}",
                f"  transfer {self.transfer.mode} ({self.transfer.basis or '?'})", f"  reuse    {self.reuse}", f"  verdict  {self.verdict}",
                *(f"  {f.level}: {f.text}" for f in self.findings)]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "verdict": self.verdict}


# -- gathering ---------------------------------------------------------------------------------------
class PinnedIdsProof:
    """Proves, engine by engine, that it uses the prompt ids it is sent (`EngineFacts.pinned_ids`); until then, and
    while a proof runs, the engine is unproven: its legs carry the whole history, and its P legs keep the echo
    and the parity check."""

    def __init__(self, client: EngineClient, renderer: Renderer | None, model: str | None) -> None:
        self.client, self.model = client, model
        self.pinned = _render_probe(renderer, PINNED_PROBE_MESSAGES)
        self._running: set[asyncio.Task] = set()

    async def prove(self, engine: Engine) -> bool | None:
        engine.facts.pinned_ids = False
        if self.pinned is None:
            return None
        model = self.model or engine.facts.served_model
        result = await honours_pinned_ids(self.client, engine, PROBE_MESSAGES, self.pinned, model)
        engine.facts.pinned_ids = result is True
        return result

    def engine_back(self, engine: Engine) -> None:
        """The health checker's hook: an engine back in rotation may be another vLLM; unproven until shown."""
        engine.facts.pinned_ids = False          # at once: a turn picking it now keeps the check
        task = asyncio.create_task(self.prove(engine))
        self._running.add(task)
        task.add_done_callback(lambda done: self._logged(done, engine))

    def _logged(self, task: asyncio.Task, engine: Engine) -> None:
        self._running.discard(task)
        if not task.cancelled() and task.exception() is None:
            log.info("%s %s is back:%s", engine.role, mask_url(engine.url),
                     findings.pinned_words(task.result(), engine.role))


async def gather(client: EngineClient, prefill: EnginePool, decode: EnginePool, renderer: Renderer | None,
                 store: ConversationStore, settings: Settings) -> StartupReport:
    engines = [*prefill.engines.values(), *decode.engines.values()]
    expected = _render_probe(renderer)
    proof = PinnedIdsProof(client, renderer, settings.model)
    reports = list(await asyncio.gather(*(_engine_report(client, e, expected, settings.model, proof)
                                          for e in engines)))
    store_ok = await _ping(store)
    models = [settings.model] if settings.model else next((r.models for r in reports if r.models), [])
    sizes = {r.block_size for r in reports if r.block_size}
    block_size = settings.block_size or (min(sizes) if sizes else DEFAULT_BLOCK_SIZE)
    lengths = [r.max_model_len for r in reports if r.max_model_len]
    store_name = mask_url(settings.redis_url) if settings.redis_url else "embedded (single process)"
    mode = decide(settings.kv_transfer_mode, [Seen(r.role, r.url, mode_of(r.kv_transfer)) for r in reports
                                              if r.reachable])
    if mode.push and not mode.refusal:       # each P's identity, from one pair (engines/transfer.py)
        await _push_identities(PushIdentities(client, decode, settings.model, block_size), prefill, reports)
    found = [*findings.reachability(reports), *findings.agreement(reports, settings),
             *findings.transfer(reports, mode), *findings.roles(reports),
             *([] if mode.push else findings.decoder_ttl(reports, settings)),
             *findings.parity(reports, renderer, expected), *findings.store(settings, store_ok)]
    return StartupReport(reports, store_name, store_ok, models, block_size, min(lengths, default=None),
                         findings.reuse(reports, settings, store_ok, mode.push), found, mode)


async def _push_identities(identities: PushIdentities, prefill: EnginePool, reports: list[EngineReport]) -> None:
    await identities.learn_all(prefill)
    for report, engine in zip(reports, prefill.engines.values(), strict=False):    # P's reports come first
        target = push_target(engine)
        report.push_identity = describe(target) if target else None


async def transfer_preflight(settings: Settings) -> ModeVerdict:
    """`serve`'s look at the engines' KV-transfer modes before it listens (engines/transfer.py)."""
    return await preflight(settings)


async def check(settings: Settings) -> StartupReport:
    """`pd-gateway check`: the same report, from a session and store of its own."""
    try:
        renderer: Renderer | None = Renderer(settings.tokenizer, settings.chat_template)
    except Exception as exc:  # a bad tokenizer is itself a finding; report the engines anyway
        log.error("tokenizer %r could not be loaded: %s", settings.tokenizer, exc)
        renderer = None
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=settings.connect_timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        store = open_store(settings.redis_url, settings.conversation_ttl_s)
        try:
            prefill, decode = await resolved(settings.prefill, settings.decode, settings.discovery_nameserver)
            return await gather(EngineClient(session), EnginePool("prefill", prefill),
                                EnginePool("decode", decode), renderer, store, settings)
        finally:
            await store.close()


def log_report(report: StartupReport, logger: logging.Logger = log) -> None:
    level = {"ok": logging.INFO, "warn": logging.WARNING, "fail": logging.ERROR}[report.verdict]
    logger.log(level, "\n".join(report.lines()), extra={"fields": {"startup_report": report.to_dict()}})


def _render_probe(renderer: Renderer | None, messages: list[dict[str, Any]] = PROBE_MESSAGES) -> list[int] | None:
    if renderer is None:
        return None
    try:
        return renderer.render_chat(messages)
    except GatewayError:
        return None


async def _engine_report(client: EngineClient, engine: Engine, expected: list[int] | None,
                         model: str | None, proof: PinnedIdsProof) -> EngineReport:
    try:
        await client.get(engine.url, "/health", timeout_s=PROBE_TIMEOUT_S)
    except GatewayError:
        return EngineReport(mask_url(engine.url), engine.role, reachable=False)
    read = await probe(client, engine)
    report = EngineReport(mask_url(engine.url), engine.role, True, read.version, read.block_size, read.models,
                          read.max_model_len, read.kv_transfer)
    if expected is not None:
        served = model or next(iter(report.models), None)
        report.parity, report.parity_detail = _compare(expected, await tokenize_chat(client, engine,
                                                                                     PROBE_MESSAGES, served))
    report.pinned_ids = await proof.prove(engine)     # P and D alike: a proven engine is sent no history text
    return report


def _compare(expected: list[int], got: list[int] | None) -> tuple[Literal["match", "mismatch", "unknown"], str]:
    if got is None:
        return "unknown", "the engine has no /tokenize for messages"
    if got == expected:
        return "match", f"{len(expected)} tokens"
    first = next((i for i, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b),
                 min(len(expected), len(got)))
    return "mismatch", f"first difference at token {first}; gateway {len(expected)} tokens, engine {len(got)}"


async def _ping(store: ConversationStore) -> bool:
    try:
        return bool(await store.ping())
    except Exception:  # any store failure is a finding, not a crash
        return False


