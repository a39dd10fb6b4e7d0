"""The embedded store's prefix index: (tenant, index hash) → the conversations filed there, each with its
handle's expiry, soonest-expiring first. The store files an entry when a live handle is stored or put back and
unfiles it when the handle is claimed or replaced and when its conversation is deleted, expires or is evicted,
so the index never holds more than one entry per conversation."""

from __future__ import annotations

from collections.abc import Iterator
from itertools import islice

from .base import ConversationKey

_IndexKey = tuple[str, bytes]  # (tenant, index hash)


class PrefixIndex:
    def __init__(self) -> None:
        self._members: dict[_IndexKey, dict[ConversationKey, float]] = {}

    def live(self, tenant: str, digest: bytes, now: float, limit: int) -> list[ConversationKey]:
        """Up to `limit` conversations filed under `digest` whose handles are still live. Listed before the
        caller touches any entry: reading an expired entry unfiles it from the same set."""
        members = self._members.get((tenant, digest))
        if not members:
            return []
        return list(islice((key for key, expires_at in members.items() if expires_at > now), limit))

    def file(self, key: ConversationKey, digest: bytes, expires_at: float, now: float) -> None:
        members = self._members.setdefault((key.tenant, digest), {})
        # Dead handles leave first, as in Redis, so a set many identical conversations share stays the size of
        # its live holders. Kept in expiry order (a put-back files an older handle after newer ones).
        while members and next(iter(members.values())) <= now:
            del members[next(iter(members))]
        in_order = not members or next(reversed(members.values())) <= expires_at
        members[key] = expires_at
        if not in_order:
            self._members[(key.tenant, digest)] = dict(sorted(members.items(), key=lambda item: item[1]))

    def unfile(self, key: ConversationKey, digest: bytes) -> None:
        where = (key.tenant, digest)
        members = self._members.get(where)
        if members is not None:
            members.pop(key, None)
            if not members:
                del self._members[where]

    def clear(self) -> None:
        self._members.clear()

    def __iter__(self) -> Iterator[_IndexKey]:
        return iter(self._members)
