"""What an engine says about itself: served models and `max_model_len` (from /v1/models), vLLM version, KV block
size and capacity in blocks (from /metrics), its KV-transfer config (from /server_info, which vLLM serves only with
VLLM_SERVER_DEV_MODE=1), and how it tokenizes a chat."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from gateway.engines import kv
from gateway.engines.capacity import kv_capacity
from gateway.engines.client import EngineClient
from gateway.engines.engine import Engine
from gateway.engines.facts import EngineFacts, KvTransfer
from gateway.errors import EngineTimeoutError, GatewayError

PROBE_TIMEOUT_S = 3.0
SERVER_INFO_TIMEOUT_S = 10.0        # vLLM serializes its whole config: slow on a busy engine just started
SERVER_INFO_ATTEMPTS = 3            # a slow answer is retried: only an answer (or a 404) says what it shows
PINNED_PROBE_TIMEOUT_S = 15.0       # it generates a token: an engine's first request can be slow


async def probe(client: EngineClient, engine: Engine) -> EngineFacts:
    """Read what the engine says of itself into `engine.facts`; missing pieces stay missing (the engine may be
    starting). Returns what this probe read."""
    models, version, metrics, server_info = await asyncio.gather(
        _get(client, engine.url, "/v1/models"), _get(client, engine.url, "/version"),
        _get(client, engine.url, "/metrics"), server_info_of(client, engine.url))
    read = EngineFacts()
    if models:
        data = _json(models).get("data")
        cards = [m for m in data if isinstance(m, dict)] if isinstance(data, list) else []
        read.models = [m["id"] for m in cards if "id" in m]
        if lengths := [m["max_model_len"] for m in cards if _positive_int(m.get("max_model_len"))]:
            read.max_model_len = min(lengths)
    if version:
        read.version = _json(version).get("version")
    capacity = kv_capacity(metrics.decode("utf-8", "replace")) if metrics else None
    if capacity:
        read.block_size, read.num_gpu_blocks = capacity.block_size or None, capacity.num_gpu_blocks or None
    if server_info:
        read.kv_transfer = kv_transfer_of(server_info)
    engine.facts.update(read)
    return read


async def server_info_of(client: EngineClient, url: str) -> dict[str, Any] | None:
    """vLLM's dev-mode `/server_info?config_format=json`; None when the engine has none (404: no dev mode) or does
    not answer after a few tries. A timeout is not "none": it decides the KV-transfer mode (engines/transfer.py)."""
    for _ in range(SERVER_INFO_ATTEMPTS):
        try:
            return _json(await client.get(url, "/server_info?config_format=json", timeout_s=SERVER_INFO_TIMEOUT_S))
        except EngineTimeoutError:
            continue
        except GatewayError:
            return None
    return None


def kv_transfer_of(server_info: dict[str, Any]) -> KvTransfer | None:
    """The parts of vLLM's `kv_transfer_config` that matter for PD: connector, role, policy, bidirectional."""
    config = server_info.get("vllm_config")
    kv = config.get("kv_transfer_config") if isinstance(config, dict) else None
    if not isinstance(kv, dict):
        return None
    extra = kv.get("kv_connector_extra_config") or {}
    ttl, lease = extra.get("decoder_kv_blocks_ttl"), extra.get("kv_lease_duration")
    inner = extra.get("connectors")           # a MultiConnector's own connectors (docs/protocol.md §8.5)
    inner = inner if isinstance(inner, list) else []
    return KvTransfer(
        connector=kv.get("kv_connector"), role=kv.get("kv_role"), engine_id=kv.get("engine_id"),
        connectors=tuple(c.get("kv_connector") for c in inner if isinstance(c, dict)),
        failure_policy=kv.get("kv_load_failure_policy", "fail"),
        bidirectional=bool(extra.get("bidirectional_kv_xfer", False)),
        decoder_kv_blocks_ttl=float(ttl) if isinstance(ttl, (int, float)) and ttl > 0 else None,
        kv_lease_duration=float(lease) if isinstance(lease, (int, float)) and lease > 0 else None)


async def tokenize_chat(client: EngineClient, engine: Engine, messages: list[dict[str, Any]],
                        model: str | None) -> list[int] | None:
    """The engine's own rendering of `messages` (POST /tokenize, messages form), or None if it has none."""
    answer = await _ask(client, engine, "/tokenize", {"messages": messages, "add_generation_prompt": True},
                        model, PROBE_TIMEOUT_S)
    tokens = answer.get("tokens") if answer else None
    return tokens if isinstance(tokens, list) else None


async def honours_pinned_ids(client: EngineClient, engine: Engine, messages: list[dict[str, Any]],
                             pinned: list[int], model: str | None) -> bool | None:
    """Whether the engine uses `kv_transfer_params.prompt_token_ids` instead of rendering the messages (vLLM
    0.32+, docs/protocol.md §5). `pinned` must differ from the messages' rendering: the engine is asked for one
    token and its echoed prompt says which it used. True: the pinned ids; False: it rendered (or used something
    else); None: no usable answer. Only True proves anything."""
    body = {"messages": messages, "max_tokens": 1, "stream": False, "return_token_ids": True,
            kv.WIRE_KEY: kv.pinned_only(pinned)}
    answer = await _ask(client, engine, "/v1/chat/completions", body, model, PINNED_PROBE_TIMEOUT_S)
    echoed = answer.get("prompt_token_ids") if answer else None
    return echoed == pinned if isinstance(echoed, list) else None


def pinned_ids_proven(engine: Engine) -> bool:
    """A P leg on this engine needs no echo of its prompt to confirm parity: it uses the ids it is sent."""
    return engine.facts.pinned_ids is True


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _json(payload: bytes) -> dict[str, Any]:
    try:
        value = msgspec.json.decode(payload)
    except msgspec.DecodeError:
        return {}
    return value if isinstance(value, dict) else {}


async def _get(client: EngineClient, url: str, path: str) -> bytes | None:
    try:
        return await client.get(url, path, timeout_s=PROBE_TIMEOUT_S)
    except GatewayError:
        return None


async def _ask(client: EngineClient, engine: Engine, path: str, body: dict[str, Any], model: str | None,
               timeout_s: float) -> dict[str, Any] | None:
    """POST a probe (naming the served model when known); None when the engine gives no usable answer."""
    try:
        return await client.post_json(engine.url, path, {**body, "model": model} if model else body,
                                      timeout_s=timeout_s)
    except GatewayError:
        return None
