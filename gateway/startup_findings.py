"""What the start-up report finds in the engines' reports (`pd-gateway check`, and the log at start): each a
`Finding` with its level (ok, warn, fail), and one sentence on what the set-up means for reuse. Pure: the
gathering is `startup.py`'s."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from gateway.config import Settings
from gateway.engines.facts import KvTransfer
from gateway.engines.transfer import ModeVerdict, mode_findings
from gateway.turns.intake.render import Renderer

DEFAULT_BLOCK_SIZE = 16
# The protocol notes once said recompute on P; real vLLM 0.32 parks a declined read under it (docs/vllm-findings.md #8)
RECOMMENDED_POLICY = {"prefill": "fail", "decode": "fail"}
# The kv_role an engine must have to serve a pool (kv_both serves either).
ROLES = {"prefill": ("kv_producer", "kv_both"), "decode": ("kv_consumer", "kv_both")}
Level = Literal["ok", "warn", "fail"]


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
                f"{pinned_words(self.pinned_ids, self.role)}"
                f"{f'  push identity {self.push_identity}' if self.push_identity else ''}")


def pinned_words(pinned: bool | None, role: str = "prefill") -> str:
    used, not_used = (("P echoes no prompt, is sent no history text", "P echoes its prompt for a parity check")
                      if role == "prefill" else ("D is sent no history text", "D is sent the whole history"))
    words = {True: f"used ({used})", False: f"ignored ({not_used})", None: f"unknown ({not_used})"}
    return f"  pinned prompt ids {words[pinned]}"



def reachability(reports: list[EngineReport]) -> list[Finding]:
    out = []
    for role in ("prefill", "decode"):
        mine = [r for r in reports if r.role == role]
        down = [r.url for r in mine if not r.reachable]
        if len(down) == len(mine):
            out.append(Finding("fail", f"no {role} engine answers /health ({', '.join(down) or 'none configured'})"))
        elif down:
            out.append(Finding("warn", f"{role} engines not answering: {', '.join(down)}"))
    return out


def agreement(reports: list[EngineReport], settings: Settings) -> list[Finding]:
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


def transfer(reports: list[EngineReport], mode: ModeVerdict = ModeVerdict("pull")) -> list[Finding]:
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


def roles(reports: list[EngineReport]) -> list[Finding]:
    """An engine's kv_role must fit the pool it was given: P produces KV for D, D consumes it."""
    out = []
    for r in reports:
        kv_role = r.kv_transfer.role if r.reachable and r.kv_transfer else None
        if kv_role and kv_role not in ROLES[r.role]:
            flag = "--prefill" if r.role == "prefill" else "--decode"
            out.append(Finding("fail", f"{r.url} is given as {flag} but its kv_role is {kv_role!r}: are "
                                       "--prefill and --decode swapped?"))
    return out


def decoder_ttl(reports: list[EngineReport], settings: Settings) -> list[Finding]:
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


def parity(reports: list[EngineReport], renderer: Renderer | None, expected: list[int] | None) -> list[Finding]:
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


def store(settings: Settings, store_ok: bool) -> list[Finding]:
    if not store_ok:
        return [Finding("warn", "the store does not answer: turns are served stateless (plan full, reason "
                                "store_unavailable) until it does")]
    return []


def reuse(reports: list[EngineReport], settings: Settings, store_ok: bool, push: bool = False) -> str:
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
