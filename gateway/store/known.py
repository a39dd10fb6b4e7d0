"""The block hashes this process wrote last per conversation, so a claim need not read them back from Redis.

A finish files the record's hashes under a tag of its own (`<turn>:<random>`, in the hash field `blocks_of`);
a later begin names the tag it holds, and the script answers "as you hold them" only when the stored tag is
that one, else sends the stored hashes. The tag is random per write, so an entry that went stale (another
replica's turn, a delete and a new turn of the same number) never matches: it only costs the read it saves.
Least recently written first out beyond `max_bytes`.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict

DEFAULT_KNOWN_BYTES = 64 * 1024 * 1024


def new_tag() -> str:
    """A write's tag beside its turn: 64 random bits (a fresh one for every finish)."""
    return secrets.token_hex(8)


class KnownBlocks:
    def __init__(self, max_bytes: int = DEFAULT_KNOWN_BYTES) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, tuple[str, bytes]] = OrderedDict()   # conversation key → (tag, hashes)
        self._bytes = 0

    def get(self, key: str) -> tuple[str, bytes] | None:
        return self._entries.get(key)

    def put(self, key: str, tag: str, hashes: bytes) -> None:
        self.drop(key)
        if len(hashes) > self.max_bytes:
            return
        self._entries[key] = (tag, hashes)
        self._bytes += len(hashes)
        while self._bytes > self.max_bytes:
            _, (_, old) = self._entries.popitem(last=False)
            self._bytes -= len(old)

    def drop(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= len(entry[1])

    def __len__(self) -> int:
        return len(self._entries)
