"""The deployment's KV-transfer mode, pull (`NixlConnector`) or push (`NixlPushConnector`), and in push mode each
P's identity as D legs name it (docs/protocol.md §8).

The mode is read from each engine's `/server_info` (`kv_connector`, vLLM dev mode) and may be set instead
(`--kv-transfer-mode`). Both engines of a pair must run the same one (the NIXL handshake refuses a push engine
and a pull engine), and a push D leg sent to a pull D is never answered correctly, so the gateway refuses to
start on a mixed pool, or on a push pool whose mode it cannot see for every engine unless the setting says it.

P's identity comes from P's own handle: only P knows the side channel as D must name it (the engine id in
/server_info lacks the host, port and parallelism). One pair at start-up (`PushIdentities.learn`: P first, then
D with the same id, a block's worth of tokens each) learns it, proves P and D can pair, and leaves nothing held:
D's registration meets P's staged blocks and the WRITE frees them. It is learned again when P comes back healthy
(a restarted P has a new engine id unless one is configured), and every push turn's P answer corrects it.
"""

from __future__ import annotations

import asyncio
import logging
import random
import secrets
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp

from gateway.config import Settings, mask_url
from gateway.engines import kv
from gateway.engines.client import EngineClient
from gateway.engines.discovery import resolved
from gateway.engines.engine import Engine
from gateway.engines.facts import KvTransfer
from gateway.engines.pool import EnginePool
from gateway.engines.probe import PROBE_TIMEOUT_S, kv_transfer_of, server_info_of
from gateway.errors import GatewayError

log = logging.getLogger("gateway.startup")

Mode = Literal["pull", "push"]
Setting = Literal["auto", "pull", "push"]
CONNECTOR_MODES: dict[str, Mode] = {"NixlConnector": "pull", "NixlPullConnector": "pull",
                                    "NixlPushConnector": "push"}
IDENTITY_TIMEOUT_S = 15.0              # a P's first request can be slow (compilation, warm-up)
PROBE_TOKEN_RANGE = (1, 100)           # ids every vocabulary has; random, so no prefix cache holds them


class TransferModeError(ValueError):
    """The engines' KV-transfer modes cannot work together (or contradict the setting): the gateway does not start."""


def mode_of(kv_transfer: KvTransfer | None) -> Mode | None:
    """The mode an engine's `/server_info` names; None: not shown (no dev mode, or another connector)."""
    if kv_transfer is None:
        return None
    names = [kv_transfer.connector, *kv_transfer.connectors]
    modes = {CONNECTOR_MODES[n] for n in names if n in CONNECTOR_MODES}
    return modes.pop() if len(modes) == 1 else None


@dataclass(frozen=True)
class Seen:
    """One engine as the mode decision sees it."""
    role: str
    url: str
    mode: Mode | None


@dataclass(frozen=True)
class ModeVerdict:
    mode: Mode
    refusal: str | None = None          # the gateway does not start: the one line that says why
    unseen: tuple[str, ...] = ()        # engines whose mode the setting vouches for
    basis: str = ""                     # why this mode, for the start-up report

    @property
    def push(self) -> bool:
        return self.mode == "push"


def decide(setting: Setting, engines: list[Seen]) -> ModeVerdict:
    """The mode to run in. `auto`: what the engines show (pull when none shows one: today's default); a push
    pool must show it on every engine. `pull`/`push`: that mode; an engine showing the other is refused."""
    shown = {e.mode for e in engines if e.mode}
    unseen = tuple(f"{e.role} {mask_url(e.url)}" for e in engines if e.mode is None)
    if setting == "auto":
        if len(shown) > 1:
            return ModeVerdict("pull", refusal=_mixed(engines))
        basis = "as every engine's /server_info shows" if shown and not unseen else \
            "as some engines' /server_info shows" if shown else "no engine shows its mode: pull"
        mode: Mode = next(iter(shown), "pull")
        if mode == "push" and unseen:
            return ModeVerdict("push", refusal=(
                f"engines show push mode (NixlPushConnector), but {', '.join(unseen)} show no mode (vLLM serves "
                "/server_info only with VLLM_SERVER_DEV_MODE=1): a push D leg to a pull engine fails; set "
                "--kv-transfer-mode push if they all run NixlPushConnector"))
        return ModeVerdict(mode, unseen=unseen if mode == "push" else (), basis=basis)
    other = [e for e in engines if e.mode and e.mode != setting]
    if other:
        return ModeVerdict(setting, refusal=f"--kv-transfer-mode {setting}, but " + ", ".join(
            f"{e.role} {mask_url(e.url)} runs {e.mode} mode" for e in other) + ": every engine must run "
            + ("NixlPushConnector" if setting == "push" else "NixlConnector"))
    return ModeVerdict(setting, unseen=unseen if setting == "push" else (), basis=f"--kv-transfer-mode {setting}")


def mode_findings(verdict: ModeVerdict, unlearned: list[str]) -> list[tuple[str, str]]:
    """(level, text) lines for the start-up report; `unlearned`: the P engines whose identity is not known."""
    if verdict.refusal:
        return [("fail", f"refused: {verdict.refusal}")]
    if not verdict.push:
        return []
    out = [("warn", f"push mode taken on trust (--kv-transfer-mode push) for {', '.join(verdict.unseen)}: their "
                    "/server_info shows no mode")] if verdict.unseen else []
    if unlearned:
        out.append(("warn", f"push identity not learned for {', '.join(unlearned)}: their turns send P first, then "
                            "D, until a P answer shows it"))
    return out


def _mixed(engines: list[Seen]) -> str:
    by_mode = {m: [f"{e.role} {mask_url(e.url)}" for e in engines if e.mode == m] for m in ("push", "pull")}
    return (f"mixed KV-transfer modes: push (NixlPushConnector) on {', '.join(by_mode['push'])}; pull on "
            f"{', '.join(by_mode['pull'])}. P and D must run the same connector: the NIXL handshake refuses a "
            "push engine and a pull engine (docs/protocol.md §8.1)")


async def preflight(settings: Settings) -> ModeVerdict:
    """The mode decision alone, from a session of its own: `serve` runs it before it listens, so that a refusal
    ends the start with one line instead of a failed application start-up."""
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=settings.connect_timeout_s)
    prefill, decode = await resolved(settings.prefill, settings.decode, settings.discovery_nameserver, quiet=True)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        client = EngineClient(session)
        seen = await asyncio.gather(*(_seen(client, role, url) for role, urls in
                                      (("prefill", prefill), ("decode", decode)) for url in urls))
    return decide(settings.kv_transfer_mode, [s for s in seen if s is not None])


async def _seen(client: EngineClient, role: str, url: str) -> Seen | None:
    """None: the engine does not answer (decided without it, as the start-up report does)."""
    try:
        await client.get(url, "/health", timeout_s=PROBE_TIMEOUT_S)
    except GatewayError:
        return None
    info = await server_info_of(client, url)
    return Seen(role, url, mode_of(kv_transfer_of(info)) if info else None)


def describe(target: kv.PushTarget) -> str:
    return f"{target.engine_id}@{target.host}:{target.port} tp {target.tp_size} pp {target.pp_size}"


def push_target(engine: Engine) -> kv.PushTarget | None:
    """P's identity as learned; None until it is (its push legs are then sent one after the other)."""
    return engine.facts.push_target


def remember(engine: Engine, handle: kv.Handle | None) -> kv.PushTarget | None:
    """Keep the identity a push P's handle shows (a restarted P shows a new engine id); the one now known."""
    target = kv.PushTarget.of(handle)
    if target is not None and target != push_target(engine):
        if push_target(engine) is not None:
            log.warning("prefill %s changed its push identity to %s (restarted?)", mask_url(engine.url), target)
        engine.facts.push_target = target
    return push_target(engine)


class PushIdentities:
    """Learns each P's identity in push mode with one pair of one-token legs (module docstring)."""

    def __init__(self, client: EngineClient, decode: EnginePool, model: str | None, block_size: int) -> None:
        self.client, self.decode, self.model, self.block_size = client, decode, model, block_size
        self._running: set[asyncio.Task] = set()

    async def learn(self, prefill: Engine) -> kv.PushTarget | None:
        prefill.facts.push_target = None
        rid = f"pdgw-identity-{secrets.token_hex(8)}"
        # more than a block, so that D has a whole block to register (its last token it computes itself)
        ids = [random.randrange(*PROBE_TOKEN_RANGE) for _ in range(self.block_size + 2)]
        answer = await self._post(prefill, ids, rid, kv.fresh_prefill())
        handle = kv.peek(answer) if answer else None
        if kv.transfer_mode_of(handle) == "pull":
            log.error("prefill %s answered with a pull-mode handle: it runs NixlConnector, not NixlPushConnector; "
                      "no push turn is sent to it", mask_url(prefill.url))
            return None
        target = remember(prefill, handle)
        if target is None:
            log.warning("prefill %s did not show its push identity (%s); its turns send P first, then D, until it "
                        "does", mask_url(prefill.url), "no answer" if answer is None else "no push handle")
            return None
        decode = next(iter(self.decode.healthy()), None)
        if decode is None:         # P's blocks stay leased for its kv_lease_duration
            return target
        paired = await self._post(decode, ids, rid, kv.push_decode_params(
            target, p_request_id=kv.engine_base_id("/v1/completions", rid)))
        log.log(logging.INFO if paired else logging.WARNING, "prefill %s: push identity %s; a pair with decode "
                "%s %s", mask_url(prefill.url), describe(target), mask_url(decode.url),
                "answered" if paired else "did not answer")
        return target

    async def learn_all(self, prefill: EnginePool) -> None:
        await asyncio.gather(*(self.learn(e) for e in prefill.healthy()))

    def engine_back(self, engine: Engine) -> None:
        """The health checker's hook: a P back in rotation may be a restarted engine with a new identity."""
        if engine.role != "prefill":
            return
        engine.facts.push_target = None      # at once: a turn picking it now sends P first and learns it
        task = asyncio.create_task(self.learn(engine))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _post(self, engine: Engine, ids: list[int], rid: str, params: dict[str, Any]) -> dict[str, Any] | None:
        body: dict[str, Any] = {"prompt": ids, "max_tokens": 1, "stream": False, kv.WIRE_KEY: params}
        if model := self.model or engine.facts.served_model:
            body["model"] = model
        try:
            return await self.client.post_json(engine.url, "/v1/completions", body, timeout_s=IDENTITY_TIMEOUT_S,
                                               headers={"X-Request-Id": rid})
        except GatewayError:
            return None
