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
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import aiohttp

from gateway.config import Settings, mask_url
from gateway.engines.client import EngineClient
from gateway.engines.engine import Engine
from gateway.engines.pool import EnginePool
from gateway.engines.facts import KvTransfer
from gateway.engines.probe import PROBE_TIMEOUT_S, honours_pinned_ids, probe, tokenize_chat
from gateway.engines.transfer import (ModeVerdict, PushIdentities, Seen, decide, describe, mode_findings, mode_of,
                                      preflight, push_target)
from gateway.errors import GatewayError
from gateway.store import ConversationStore, open_store
from gateway.turns.intake.render import Renderer

log = logging.getLogger("gateway.startup")
DEFAULT_BLOCK_SIZE = 16
# User / assistant / user: accepted by templates that reject system messages or demand strict alternation.
PROBE_MESSAGES = [
    {"role": "user", "content": "Hello! What is 2 + 2?"},
    {"role": "assistant", "content": "2 + 2 = 4. Anything else?"},
    {"role": "user", "content": "Yes: name three prime numbers, please."},
]
# The pinned-ids probe's ids: the rendering of this conversation, sent with PROBE_MESSAGES (same roles, so every
# template accepts both), so that an engine that renders the messages echoes other ids than the pinned ones.
PINNED_PROBE_MESSAGES = [*PROBE_MESSAGES[:2], {"role": "user", "content": "No, thank you: that was all."}]
# The protocol notes once said recompute on P; real vLLM 0.32 parks a declined read under it (docs/vllm-findings.md #8)
RECOMMENDED_POLICY = {"prefill": "fail", "decode": "fail"}
# The kv_role an engine must have to serve a pool (kv_both serves either).
ROLES = {"prefill": ("kv_producer", "kv_both"), "decode": ("kv_consumer", "kv_both")}
Level = Literal["ok", "warn", "fail"]
_RANK = {"ok": 0, "warn": 1, "fail": 2}


@dataclass
class Finding:
    level: Level
    text: str


@dataclass
class EngineReport:
    url: str
    role: str
    reachable: bool
    version: str | None = None
    block_size: int | None = None
    models: list[str] = field(default_factory=list)
    max_model_len: int | None = None              # from /v1/models
    kv_transfer: KvTransfer | None = None         # from /server_info, when the engine exposes it
    parity: Literal["match", "mismatch", "unknown"] = "unknown"
    parity_detail: str = ""
    pinned_ids: bool | None = None                # uses kv_transfer_params.prompt_token_ids (None: unknown)
    push_identity: str | None = None              # push mode, P: the identity D legs name (docs/protocol.md §8.2)

    @property
    def bidirectional(self) -> bool | None:
        return self.kv_transfer.bidirectional if self.kv_transfer else None

    def line(self) -> str:
        if not self.reachable:
            return f"{self.role:<8} {self.url}  unreachable"
        bidi = {True: "on", False: "off", None: "unknown"}[self.bidirectional]
        policy = self.kv_transfer.failure_policy if self.kv_transfer else "unknown"
        return (f"{self.role:<8} {self.url}  vLLM {self.version or '?'}  block size {self.block_size or '?'}  "
                f"bidirectional {bidi}  load-failure policy {policy}  "
                f"template parity {self.parity}{f' ({self.parity_detail})' if self.parity_detail else ''}"
                f"{_pinned_words(self.pinned_ids, self.role)}"
                f"{f'  push identity {self.push_identity}' if self.push_identity else ''}")


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
            log.info("%s %s is back:%s", engine.role, mask_url(engine.url), _pinned_words(task.result(), engine.role))


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
    findings = [*_reachability(reports), *_agreement(reports, settings), *_transfer(reports, mode),
                *_roles(reports), *([] if mode.push else _decoder_ttl(reports, settings)),
                *_parity(reports, renderer, expected), *_store(settings, store_ok)]
    return StartupReport(reports, store_name, store_ok, models, block_size, min(lengths, default=None),
                         _reuse(reports, settings, store_ok, mode.push), findings, mode)


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
            return await gather(EngineClient(session), EnginePool("prefill", settings.prefill),
                                EnginePool("decode", settings.decode), renderer, store, settings)
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


def _pinned_words(pinned: bool | None, role: str = "prefill") -> str:
    used, not_used = (("P echoes no prompt, is sent no history text", "P echoes its prompt for a parity check")
                      if role == "prefill" else ("D is sent no history text", "D is sent the whole history"))
    words = {True: f"used ({used})", False: f"ignored ({not_used})", None: f"unknown ({not_used})"}
    return f"  pinned prompt ids {words[pinned]}"


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


# -- findings ----------------------------------------------------------------------------------------
def _reachability(reports: list[EngineReport]) -> list[Finding]:
    out = []
    for role in ("prefill", "decode"):
        mine = [r for r in reports if r.role == role]
        down = [r.url for r in mine if not r.reachable]
        if len(down) == len(mine):
            out.append(Finding("fail", f"no {role} engine answers /health ({', '.join(down) or 'none configured'})"))
        elif down:
            out.append(Finding("warn", f"{role} engines not answering: {', '.join(down)}"))
    return out


def _agreement(reports: list[EngineReport], settings: Settings) -> list[Finding]:
    """P and D must match for the NIXL handshake: version, model, and (bidirectional) block size."""
    up = [r for r in reports if r.reachable]
    out = []
    versions = {r.version for r in up if r.version}
    if len(versions) > 1:
        out.append(Finding("fail", f"engines run different vLLM versions {sorted(versions)}: the NIXL handshake "
                                   "between them fails"))
    sizes = {r.block_size for r in up if r.block_size}
    if len(sizes) > 1:
        out.append(Finding("fail", f"engines disagree on KV block size {sorted(sizes)}: bidirectional transfer "
                                   "needs equal sizes"))
    elif not sizes and up:
        out.append(Finding("warn", "no engine reported its KV block size (vllm:cache_config_info); using "
                                   f"{settings.block_size or DEFAULT_BLOCK_SIZE}"))
    elif settings.block_size and sizes and settings.block_size not in sizes:
        out.append(Finding("fail", f"block_size is set to {settings.block_size} but the engines use {sizes.pop()}"))
    served = {tuple(r.models) for r in up if r.models}
    if len(served) > 1:
        out.append(Finding("fail", f"engines serve different models {sorted(served)}"))
    if settings.model and served and not any(settings.model in m for m in served):
        out.append(Finding("fail", f"model {settings.model!r} is not served by the engines ({sorted(served)})"))
    return out


def _transfer(reports: list[EngineReport], mode: ModeVerdict = ModeVerdict("pull")) -> list[Finding]:
    up = [r for r in reports if r.reachable]
    off = [r.url for r in up if r.bidirectional is False]
    unlearned = [r.url for r in up if r.role == "prefill" and not r.push_identity]
    out = [Finding(level, text) for level, text in mode_findings(mode, unlearned)]   # type: ignore[arg-type]
    if off and not mode.push:      # push mode refuses bidirectional transfer (docs/protocol.md §8.1)
        out.append(Finding("fail", f"bidirectional_kv_xfer is off on {', '.join(off)}: no turn can reuse D's KV, "
                                   "and a P without it parks requests that carry D's handle"))
    if not mode.push and any(r.bidirectional is None for r in up):
        out.append(Finding("warn", "bidirectional transfer could not be checked on some engines (vLLM shows its "
                                   "config at /server_info only with VLLM_SERVER_DEV_MODE=1)"))
    for r in up:
        policy = r.kv_transfer.failure_policy if r.kv_transfer else None
        if policy and policy != RECOMMENDED_POLICY[r.role]:
            # P under recompute never answers a read it declined (docs/vllm-findings.md #8): a hung turn
            level: Level = "fail" if r.role == "prefill" else "warn"
            out.append(Finding(level, f"{r.role} {r.url} has kv_load_failure_policy {policy!r}; use "
                                      f"{RECOMMENDED_POLICY[r.role]!r} (see docs/deployment.md)"))
    return out


def _roles(reports: list[EngineReport]) -> list[Finding]:
    """An engine's kv_role must fit the pool it was given: P produces KV for D, D consumes it."""
    out = []
    for r in reports:
        kv_role = r.kv_transfer.role if r.reachable and r.kv_transfer else None
        if kv_role and kv_role not in ROLES[r.role]:
            flag = "--prefill" if r.role == "prefill" else "--decode"
            out.append(Finding("fail", f"{r.url} is given as {flag} but its kv_role is {kv_role!r}: are "
                                       "--prefill and --decode swapped?"))
    return out


def _decoder_ttl(reports: list[EngineReport], settings: Settings) -> list[Finding]:
    """The gateway drops a handle before D unpins its blocks only if it knows D's decoder_kv_blocks_ttl."""
    out = []
    for r in reports:
        if r.role != "decode" or not r.reachable or not r.kv_transfer:
            continue
        ttl = r.kv_transfer.ttl_s
        if ttl != settings.decoder_kv_blocks_ttl_s:
            out.append(Finding("fail", f"decode {r.url} has decoder_kv_blocks_ttl {ttl:g} s but the gateway's "
                                       f"--decoder-kv-blocks-ttl-s is {settings.decoder_kv_blocks_ttl_s:g} s: "
                                       "set them equal (a longer gateway value reads freed blocks)"))
        lease = r.kv_transfer.lease_s
        if settings.local_prefill_max_tokens and lease != settings.decode_kv_lease_s:
            out.append(Finding("fail", f"decode {r.url} has kv_lease_duration {lease:g} s but the gateway's "
                                       f"--decode-kv-lease-s is {settings.decode_kv_lease_s:g} s: set them equal "
                                       "(a local turn's handle lives D's lease; a longer gateway value reads "
                                       "freed blocks, silently: such handles have no expiry)"))
    return out


def _parity(reports: list[EngineReport], renderer: Renderer | None, expected: list[int] | None) -> list[Finding]:
    if renderer is None:
        return [Finding("fail", "the gateway's tokenizer could not be loaded: no prompt can be rendered")]
    if expected is None:
        return [Finding("warn", "the gateway's chat template could not render the probe conversation")]
    out = []
    for r in reports:
        if r.parity == "mismatch":
            out.append(Finding("fail", f"template parity: {r.url} renders the probe conversation differently "
                                       f"({r.parity_detail}); give the gateway the engine's --tokenizer and "
                                       "--chat-template"))
        elif r.reachable and r.parity == "unknown":
            out.append(Finding("warn", f"template parity unknown for {r.url}: {r.parity_detail}"))
    return out


def _store(settings: Settings, store_ok: bool) -> list[Finding]:
    if not store_ok:
        return [Finding("warn", "the store does not answer: turns are served stateless (plan full, reason "
                                "store_unavailable) until it does")]
    return []


def _reuse(reports: list[EngineReport], settings: Settings, store_ok: bool, push: bool = False) -> str:
    if push and store_ok:
        local = (f"a later turn goes to the same D alone (local) when D would compute at most "
                 f"{settings.local_prefill_max_tokens} tokens itself, counting on D's prefix cache, which nothing "
                 "pins (a lost cache costs time, never correctness)" if settings.local_prefill_max_tokens else
                 "the local path is off")
        return ("push: P writes its KV into D's blocks while both legs run; no D->P read exists and D returns no "
                f"handle, so nothing is pinned between turns; {local}; else a full prefill on P (reason "
                "push_mode), P's and D's own prefix caches skipping what they hold")
    if not push and any(r.bidirectional is False for r in reports):
        return "off: bidirectional transfer is off on some engine, so every turn is a full prefill"
    if not store_ok:
        return "degraded: the store does not answer, so every turn is a full prefill until it does"
    scope = ("a conversation must stay on this one gateway process (state is lost on restart; pass --redis-url "
             "to share it)" if not settings.redis_url else "any gateway replica sharing this Redis can reuse")
    local = (f"; the local path (D alone) for suffixes up to {settings.local_prefill_max_tokens} tokens on turns "
             f"that come within {settings.lease_ttl_s:g} s of the previous one (D's kv_lease_duration "
             f"{settings.decode_kv_lease_s:g} s - --prefill-handle-timeout-s - 5 s)"
             if settings.local_prefill_max_tokens else "; the local path is off")
    return (f"on: a later turn reuses D's KV if it comes within {settings.handle_ttl_s:g} s of the previous one "
            f"(decoder_kv_blocks_ttl {settings.decoder_kv_blocks_ttl_s:g} s - margin "
            f"{settings.handle_ttl_margin_s:g} s){local}; {scope}")
