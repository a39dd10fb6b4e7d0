"""The embedded store's stored responses: encoded as in Redis, each expiring with the conversation TTL, least
recently put out first beyond a byte bound (a response keeps its conversation's token ids and messages, so a
long agent loop's responses weigh what their histories weigh)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from .base import StoredResponse, check_response_id, check_tenant, response_meta
from .codec import decode_response, encode_response

DEFAULT_MAX_RESPONSE_BYTES = 512 * 1024 * 1024


class MemoryResponses:
    def __init__(self, ttl_s: float, clock: Callable[[], float], max_bytes: int = DEFAULT_MAX_RESPONSE_BYTES) -> None:
        self.ttl_s, self._clock, self.max_bytes = ttl_s, clock, max_bytes
        # Ordered by put: with one TTL for all, the front is also the first to expire.
        self._entries: OrderedDict[tuple[str, str], tuple[bytes, bytes, float]] = OrderedDict()   # meta, whole
        self._bytes = 0

    def put(self, tenant: str, response_id: str, response: StoredResponse) -> None:
        key = _key(tenant, response_id)
        blob = encode_response(response)
        self._drop(key)
        now = self._clock()
        self._entries[key] = (encode_response(response_meta(response)), blob, now + self.ttl_s)
        self._bytes += len(blob)
        while self._entries:
            oldest, (_, old, expires_at) = next(iter(self._entries.items()))
            if expires_at > now and self._bytes <= self.max_bytes:
                break
            self._drop(oldest)

    def get(self, tenant: str, response_id: str, bulk: bool = True) -> StoredResponse | None:
        key = _key(tenant, response_id)
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry[2] <= self._clock():
            self._drop(key)
            return None
        return decode_response(entry[1] if bulk else entry[0])

    def delete(self, tenant: str, response_id: str) -> bool:
        key = _key(tenant, response_id)
        live = key in self._entries and self._entries[key][2] > self._clock()
        self._drop(key)
        return live

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0

    def _drop(self, key: tuple[str, str]) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= len(entry[1])


def _key(tenant: str, response_id: str) -> tuple[str, str]:
    check_tenant(tenant)
    check_response_id(response_id)
    return tenant, response_id


class ResponseMethods:
    """The store contract's response methods, for a store that keeps a `MemoryResponses` as `_responses`."""

    _responses: MemoryResponses

    async def put_response(self, tenant: str, response_id: str, response: StoredResponse) -> None:
        self._responses.put(tenant, response_id, response)

    async def get_response(self, tenant: str, response_id: str, bulk: bool = True) -> StoredResponse | None:
        return self._responses.get(tenant, response_id, bulk)

    async def delete_response(self, tenant: str, response_id: str) -> bool:
        return self._responses.delete(tenant, response_id)
