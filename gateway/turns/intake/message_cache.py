"""A chat request's messages, each decoded and prepared once: a continuous turn resends every earlier message
byte for byte, so a message is found by its bytes and what was made of it before is used again.

`MessageCache` maps a message's JSON bytes, exactly as the client sent them, to a `KnownMessage`: the decoded
object, its validated struct, its JSON as the legs forward it, and memos of what later steps compute from the
message alone (its form for the chat template, its tool calls' check, their key). Found by equal bytes, not by
a digest: nothing is assumed. A request's `Messages` is the list of decoded objects that the rest of the
gateway reads as before, with the known messages beside it.

The decoded objects are shared by every request that sends the same bytes: nothing may change them in place
(what changes a message, e.g. normalizing it for the template, makes a new dict).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

DEFAULT_MESSAGE_BYTES = 64 * 1024 * 1024
T = TypeVar("T")


class KnownMessage:
    __slots__ = ("value", "struct", "json", "size", "memo")

    def __init__(self, value: dict[str, Any], struct: Any, json: bytes, size: int) -> None:
        self.value, self.struct, self.json, self.size = value, struct, json, size
        self.memo: dict[str, Any] = {}

    def once(self, name: str, compute: Callable[[], T]) -> T:
        """`compute()` the first time (a function of this message alone), its value after. An exception is not
        kept: an invalid message is refused every time, naming its place in that request."""
        try:
            return self.memo[name]
        except KeyError:
            value = self.memo[name] = compute()
            return value


class MessageCache:
    """Raw message bytes → KnownMessage, least recently used out first beyond `max_bytes` (`KnownMessage.size`:
    four times the raw size, for the bytes, the decoded strings, the forwarded JSON and the template's copy,
    plus the objects around them)."""

    def __init__(self, max_bytes: int = DEFAULT_MESSAGE_BYTES) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[bytes, KnownMessage] = OrderedDict()
        self._bytes = 0
        self.hits = self.misses = 0

    def get_all(self, raws: list[bytes]) -> list[KnownMessage | None]:
        """The known message for each of `raws` (None: not seen, or evicted), each made most recently used."""
        entries = self._entries
        found = list(map(entries.get, raws))
        touch = entries.move_to_end
        for raw, known in zip(raws, found):
            if known is not None:
                touch(raw)
        missed = found.count(None)
        self.misses += missed
        self.hits += len(found) - missed
        return found

    def put(self, raw: bytes, known: KnownMessage) -> None:
        if raw in self._entries or known.size > self.max_bytes:
            return
        self._entries[raw] = known
        self._bytes += known.size
        while self._bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self._bytes -= old.size

    @property
    def bytes(self) -> int:
        return self._bytes


class Messages(list):
    """The decoded messages of one request (what `body["messages"]` holds), with each one's KnownMessage and
    a key per message (equal messages, equal keys) for `prompts.Lineage`."""

    __slots__ = ("known", "keys")

    def __init__(self, known: list[KnownMessage], keys: list[Hashable]) -> None:
        super().__init__([k.value for k in known])
        self.known, self.keys = known, keys

    @property
    def json(self) -> bytes:
        """The messages as the legs forward them: the JSON array of each one's encoding."""
        return b"[" + b",".join(k.json for k in self.known) + b"]"


def memo(messages: list[dict[str, Any]], i: int, name: str, compute: Callable[[], T]) -> T:
    """`compute()` for the i-th message, kept with it when the request's messages are known ones."""
    if isinstance(messages, Messages):
        return messages.known[i].once(name, compute)
    return compute()


def each(messages: list[dict[str, Any]], name: str, compute: Callable[[dict[str, Any]], T]) -> list[T]:
    """`compute(message)` for every message, kept with the known ones."""
    if not isinstance(messages, Messages):
        return [compute(m) for m in messages]
    out = []
    for known in messages.known:
        value = known.memo.get(name, _NONE)
        if value is _NONE:
            value = known.memo[name] = compute(known.value)
        out.append(value)
    return out


_NONE = object()
