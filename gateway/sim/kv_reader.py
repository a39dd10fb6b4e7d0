"""Reader side of KV transfer: the sim-to-sim HTTP calls that stand in for NIXL.

Endpoints served by every connector sim (see `engine_app.py`; push mode's two are in `push.py`):
  POST /sim/kv/read       {request_id, engine_id, block_ids, block_size, reader} -> {blocks: [[[tok, pos], ...]]}
  POST /sim/kv/notify     {request_id, engine_id, reader}                        -> {claim}
  POST /sim/kv/heartbeat  {request_id, engine_id}                                -> {extended}
A read or a notification frees the holder's blocks for that handle (single use).
"""

from __future__ import annotations

from typing import Any

import aiohttp
import msgspec

from gateway.sim.blocks import Slot

TRANSFER_TIMEOUT_S = 5.0  # an unreachable holder fails the load after about this long
KEEPALIVE_S = 4.0         # below the other sims' keep-alive (uvicorn's 5 s)


class KVReadRequest(msgspec.Struct):
    request_id: str
    engine_id: str
    block_ids: list[int]
    block_size: int
    reader: str


class KVReadResponse(msgspec.Struct):
    blocks: list[list[tuple[int, int]]]
    claim: str


class KVNotifyRequest(msgspec.Struct):
    request_id: str
    engine_id: str
    reader: str


class KVHeartbeatRequest(msgspec.Struct):
    request_id: str
    engine_id: str


class TransferError(Exception):
    """The holder could not be reached or refused the handshake (engine id or block size mismatch)."""


class HolderAddress(msgspec.Struct, frozen=True):
    host: str
    port: int
    engine_id: str
    request_id: str

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> HolderAddress:
        return cls(str(params.get("remote_host")), int(params.get("remote_port") or 0),
                   str(params.get("remote_engine_id")), str(params.get("remote_request_id")))

    def url(self, path: str) -> str:
        return f"http://{self.host}:{self.port}{path}"


class KVClient:
    """Pooled HTTP client for reads, notifications and heartbeats to other sims."""

    def __init__(self, reader_engine_id: str, block_size: int) -> None:
        self.reader = reader_engine_id
        self.block_size = block_size
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        # other sims close a connection idle for uvicorn's 5 s, as vLLM does: a read must not race that close
        self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(keepalive_timeout=KEEPALIVE_S),
                                              timeout=aiohttp.ClientTimeout(total=TRANSFER_TIMEOUT_S))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def read(self, holder: HolderAddress, block_ids: list[int]) -> list[list[Slot]]:
        body = KVReadRequest(holder.request_id, holder.engine_id, block_ids, self.block_size, self.reader)
        raw = await self.post(holder.url("/sim/kv/read"), body)
        reply = msgspec.json.decode(raw, type=KVReadResponse)
        return [[tuple(slot) for slot in block] for block in reply.blocks]  # type: ignore[misc]

    async def notify(self, holder: HolderAddress) -> None:
        await self.post(holder.url("/sim/kv/notify"), KVNotifyRequest(holder.request_id, holder.engine_id,
                                                                       self.reader))

    async def heartbeat(self, holder: HolderAddress) -> None:
        await self.post(holder.url("/sim/kv/heartbeat"), KVHeartbeatRequest(holder.request_id, holder.engine_id))

    async def post(self, url: str, body: msgspec.Struct) -> bytes:
        assert self._session is not None, "KVClient.start() not called"
        try:
            async with self._session.post(url, data=msgspec.json.encode(body),
                                          headers={"content-type": "application/json"}) as resp:
                raw = await resp.read()
                if resp.status != 200:
                    raise TransferError(f"{url}: HTTP {resp.status}: {raw[:200]!r}")
                return raw
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise TransferError(f"{url}: {exc!r}") from exc
