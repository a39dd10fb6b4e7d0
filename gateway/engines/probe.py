"""What an engine says about itself: served models, vLLM version, KV block size (from /metrics)."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import msgspec

from gateway.engines.client import EngineClient
from gateway.engines.pool import Engine
from gateway.errors import GatewayError

_BLOCK_SIZE = re.compile(rb'vllm:cache_config_info\{[^}]*block_size="(\d+)"')
PROBE_TIMEOUT_S = 3.0


async def probe(client: EngineClient, engine: Engine) -> dict[str, Any]:
    """Fill `engine.info` with what could be read; missing pieces stay missing (the engine may be starting)."""
    models, version, metrics = await asyncio.gather(
        _get(client, engine.url, "/v1/models"), _get(client, engine.url, "/version"),
        _get(client, engine.url, "/metrics"))
    info: dict[str, Any] = {}
    if models:
        info["models"] = [m["id"] for m in msgspec.json.decode(models).get("data", [])]
    if version:
        info["version"] = msgspec.json.decode(version).get("version")
    if metrics and (match := _BLOCK_SIZE.search(metrics)):
        info["block_size"] = int(match.group(1))
    engine.info.update(info)
    return info


async def _get(client: EngineClient, url: str, path: str) -> bytes | None:
    try:
        return await client.get(url, path, timeout_s=PROBE_TIMEOUT_S)
    except (GatewayError, msgspec.DecodeError):
        return None
