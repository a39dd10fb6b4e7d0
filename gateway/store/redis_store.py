"""The shared store: one Redis hash per conversation plus a per-tenant prefix index, every operation one
round trip (see scripts.py for the layout).

Connection faults of any kind become `StoreUnavailableError` at this boundary. Commands are never retried:
a retried `begin_turn` whose first reply was lost would run the claim twice and lose the handle, and a
store that is down should cost a turn its reuse, not its latency.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import NoScriptError, RedisError

from . import scripts, topology
from .base import (
    DEFAULT_CONVERSATION_TTL_S,
    DEFAULT_INFLIGHT_TIMEOUT_S,
    DEFAULT_MAX_HOLDERS,
    Conversation,
    ConversationKey,
    Holder,
    INDEX_HASH_BYTES,
    HolderState,
    StoreUnavailableError,
    StoredResponse,
    TurnStart,
    check_key,
    check_response_id,
    response_meta,
    check_tenant,
    index_hash,
    session_digest,
)
from .known import KnownBlocks, new_tag
from .codec import decode_handle, decode_record, decode_response, encode_handle, encode_record, encode_response

KEY_LAYOUT = "v2"  # bumped (with a migration) whenever the key or hash layout changes
DEFAULT_CONNECT_TIMEOUT_S = 0.5
DEFAULT_OP_TIMEOUT_S = 1.0


REPLICAS_KEY = f"pdgw:{KEY_LAYOUT}:replicas"   # the gateway replicas alive (pin shares), no tenant's slot


def tenant_prefix(tenant: str) -> str:
    """`pdgw:v2:{tenant}:`, the start of every key of one tenant: on Redis Cluster the `{tenant}` hash tag
    keeps a tenant's conversations and prefix index in one slot, so one script can touch them together.
    The tenant is validated safe (no braces, no ':')."""
    check_tenant(tenant)
    return f"pdgw:{KEY_LAYOUT}:{{{tenant}}}:"


def conversation_key(key: ConversationKey) -> str:
    """`pdgw:v2:{tenant}:conv:<session digest>`: the session is hashed so any character (':', '{', '*',
    surrogates) and any length up to the limit give a short, fixed-size key."""
    check_key(key)
    return f"{tenant_prefix(key.tenant)}conv:{session_digest(key.session)}"


def response_key(tenant: str, response_id: str) -> str:
    """`pdgw:v2:{tenant}:resp:<id digest>`: a stored Responses API response, in its tenant's slot. A key family
    of its own beside the conversations', so the v2 layout and its migrations are unchanged."""
    check_response_id(response_id)
    return f"{tenant_prefix(tenant)}resp:{session_digest(response_id)}"


def client_from_url(
    url: str,
    *,
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
    op_timeout_s: float | None = DEFAULT_OP_TIMEOUT_S,
) -> aioredis.Redis:
    """A redis-py asyncio client for a server, Sentinel or Cluster URL (see topology.py); hiredis parses."""
    return topology.client(url, connect_timeout_s=connect_timeout_s, op_timeout_s=op_timeout_s)


class _Script:
    """A Lua script run by EVALSHA, its source sent once the server answers NOSCRIPT (e.g. after a restart).
    redis-py's own Script object does the same plus a Protocol isinstance check per call, measured at about 1 %
    of a turn's CPU: the store runs two scripts a turn and never inside a pipeline."""

    __slots__ = ("_client", "_sha", "_source")

    def __init__(self, client: aioredis.Redis, source: str) -> None:
        self._client, self._source = client, source
        self._sha = hashlib.sha1(source.encode()).hexdigest()

    async def __call__(self, keys: list[str], args: list[Any]) -> Any:
        try:
            return await self._client.evalsha(self._sha, len(keys), *keys, *args)
        except NoScriptError:
            self._sha = await self._client.script_load(self._source)
            return await self._client.evalsha(self._sha, len(keys), *keys, *args)


class _Op:
    """One store operation's bounds: done within `seconds` (an `asyncio.timeout`, a timer: redis-py's own socket
    timeout costs a task per command, asyncio.wait_for on Python 3.11), and any fault a StoreUnavailableError."""

    __slots__ = ("_timeout",)

    def __init__(self, seconds: float | None) -> None:
        self._timeout = asyncio.timeout(seconds)

    async def __aenter__(self) -> None:
        await self._timeout.__aenter__()

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool:
        try:
            await self._timeout.__aexit__(kind, exc, tb)
        except TimeoutError as timeout:          # the operation ran past its time (redis-py dropped the connection)
            raise StoreUnavailableError("redis: TimeoutError: no answer in time") from timeout
        if isinstance(exc, (RedisError, OSError, asyncio.TimeoutError)):
            raise StoreUnavailableError(f"redis: {type(exc).__name__}: {exc}") from exc
        return False


class _Responses:
    """Stored Responses API responses: one hash per response in its tenant's slot."""

    client: aioredis.Redis
    _ttl_ms: int

    def _op(self) -> _Op:
        raise NotImplementedError

    async def put_response(self, tenant: str, response_id: str, response: StoredResponse) -> None:
        # One hash: its small fields alone (`meta`) beside the whole response, written and given its TTL in one
        # MULTI (a single key: fine on Cluster too).
        key = response_key(tenant, response_id)
        async with self._op():
            async with self.client.pipeline(transaction=True) as pipe:
                pipe.delete(key)
                pipe.hset(key, mapping={"meta": encode_response(response_meta(response)),
                                        "whole": encode_response(response)})
                pipe.pexpire(key, self._ttl_ms)
                await pipe.execute()

    async def get_response(self, tenant: str, response_id: str, bulk: bool = True) -> StoredResponse | None:
        key = response_key(tenant, response_id)
        async with self._op():
            blob = await self.client.hget(key, "whole" if bulk else "meta")
        return decode_response(blob) if blob is not None else None

    async def delete_response(self, tenant: str, response_id: str) -> bool:
        key = response_key(tenant, response_id)
        async with self._op():
            return bool(await self.client.delete(key))


class RedisConversationStore(_Responses):
    kind = "redis"

    def __init__(
        self,
        client: aioredis.Redis,
        conversation_ttl_s: float = DEFAULT_CONVERSATION_TTL_S,
        *,
        inflight_timeout_s: float = DEFAULT_INFLIGHT_TIMEOUT_S,
        clock: Callable[[], float] = time.time,
        op_timeout_s: float | None = DEFAULT_OP_TIMEOUT_S,
    ) -> None:
        self.client = client
        self.op_timeout_s = op_timeout_s     # each operation's bound (the client's own socket timeout may be none)
        self.conversation_ttl_s = conversation_ttl_s
        self.inflight_timeout_s = inflight_timeout_s
        self._ttl_ms = max(1, round(conversation_ttl_s * 1000))
        self._clock = clock  # wall clock, for the handle checks of get and delete
        self._known = KnownBlocks()  # the block hashes this process wrote: not read back by its next claim
        self._begin_turn = _Script(client, scripts.BEGIN_TURN)
        self._finish_turn = _Script(client, scripts.FINISH_TURN)
        self._delete = _Script(client, scripts.DELETE)
        self._begin_found_turn = _Script(client, scripts.BEGIN_FOUND_TURN)
        self._find_by_prefix = _Script(client, scripts.FIND_BY_PREFIX)
        self._find_or_begin = _Script(client, scripts.FIND_OR_BEGIN)
        self._evict_handle = _Script(client, scripts.EVICT_HANDLE)
        self._put_back = _Script(client, scripts.PUT_BACK)
        self._replicas = _Script(client, scripts.REPLICAS)

    @classmethod
    def from_url(
        cls,
        url: str,
        conversation_ttl_s: float = DEFAULT_CONVERSATION_TTL_S,
        *,
        inflight_timeout_s: float = DEFAULT_INFLIGHT_TIMEOUT_S,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        op_timeout_s: float = DEFAULT_OP_TIMEOUT_S,
        clock: Callable[[], float] = time.time,
    ) -> RedisConversationStore:
        # No socket timeout in the client: each operation is bounded by the store itself (`_op`).
        client = client_from_url(url, connect_timeout_s=connect_timeout_s, op_timeout_s=None)
        return cls(client, conversation_ttl_s, inflight_timeout_s=inflight_timeout_s, clock=clock,
                   op_timeout_s=op_timeout_s)

    def _op(self) -> _Op:
        return _Op(self.op_timeout_s)

    async def begin_turn(self, key: ConversationKey, now: float) -> TurnStart:
        rkey = conversation_key(key)
        known = self._known.get(rkey)
        args = [repr(float(now)), repr(float(self.inflight_timeout_s)), self._ttl_ms, *_member(key),
                known[0] if known else ""]
        async with self._op():
            begun = await self._begin_turn(keys=[rkey], args=args)
        return _begun(begun, known)

    async def begin_found_turn(self, key: ConversationKey, turn: int, now: float) -> TurnStart | None:
        rkey = conversation_key(key)
        known = self._known.get(rkey)
        args = [repr(float(now)), int(turn), self._ttl_ms, *_member(key), known[0] if known else ""]
        async with self._op():
            claimed = await self._begin_found_turn(keys=[rkey], args=args)
        if claimed is None:
            return None
        started, record, handle, expires_at, blocks = claimed
        return TurnStart(turn=int(started), record=_record(record, blocks, known), handle=decode_handle(handle),
                         handle_state="claimed", handle_expires_at=float(expires_at))

    async def find_by_prefix(
        self, tenant: str, block_hashes: Sequence[bytes], prompt_tokens: int, now: float,
        limit: int = DEFAULT_MAX_HOLDERS,
    ) -> list[Holder]:
        prefix = tenant_prefix(tenant)
        if not block_hashes or limit < 1:
            return []
        args = [repr(float(now)), int(limit), int(prompt_tokens), prefix, *block_hashes]
        async with self._op():
            rows = await self._find_by_prefix(keys=[f"{prefix}pfx:"], args=args)
        return [_holder(tenant, row, now) for row in rows]

    async def find_or_begin(
        self, tenant: str, block_hashes: Sequence[bytes], prompt_tokens: int, now: float, new: ConversationKey,
        limit: int = DEFAULT_MAX_HOLDERS,
    ) -> tuple[list[Holder], TurnStart | None]:
        # One script: the lookup and, when it finds nobody, the new conversation's begin (one slot: one tenant).
        if new.tenant != tenant:
            raise ValueError("find_or_begin: the new conversation must be the tenant's")
        if not block_hashes or limit < 1:
            return [], await self.begin_turn(new, now)
        prefix, rkey = tenant_prefix(tenant), conversation_key(new)
        args = [repr(float(now)), int(limit), int(prompt_tokens), prefix, repr(float(self.inflight_timeout_s)),
                self._ttl_ms, session_digest(new.session), *block_hashes]
        async with self._op():
            reply = await self._find_or_begin(keys=[f"{prefix}pfx:", rkey], args=args)
        holders = [_holder(tenant, row, now) for row in reply[0]]
        return holders, _begun(reply[1]) if len(reply) > 1 else None

    async def finish_turn(
        self,
        key: ConversationKey,
        turn: int,
        record: Conversation,
        handle: dict[str, Any] | None,
        handle_expires_at: float,
        now: float,
        unchanged_blocks: int = 0,
    ) -> bool:
        rkey = conversation_key(key)
        handle_blob = encode_handle(handle) if handle is not None else b""
        digest = index_hash(record) if handle is not None and handle_expires_at > now else None
        hashes = record.block_hashes
        args = [int(turn), encode_record(msgspec.structs.replace(record, block_hashes=b"")), handle_blob,
                repr(float(handle_expires_at)), self._ttl_ms, repr(float(now)), *_member(key),
                key.session.encode("utf-8", "surrogatepass"), int(record.held_tokens), digest or b""]
        # Only the blocks after those the stored hashes already hold travel; the script checks the seam.
        kept = min(max(0, unchanged_blocks), len(hashes) // INDEX_HASH_BYTES) * INDEX_HASH_BYTES
        tag = new_tag()
        self._known.drop(rkey)
        async with self._op():
            stored = 2
            if kept:
                stored = await self._finish_turn(keys=[rkey], args=[
                    *args, kept, hashes[kept - INDEX_HASH_BYTES:kept], hashes[kept:], tag])
            if stored == 2:
                stored = await self._finish_turn(keys=[rkey], args=[*args, 0, b"", hashes, tag])
        if stored == 1:
            self._known.put(rkey, f"{int(turn)}:{tag}", hashes)
        return stored == 1

    async def put_back(self, key: ConversationKey, start: TurnStart, now: float) -> bool:
        rkey = conversation_key(key)
        handle = start.handle if start.record is not None else None
        digest = index_hash(start.record) if handle is not None and start.handle_expires_at > now else None
        args = [int(start.turn), encode_handle(handle) if handle is not None else b"",
                repr(float(start.handle_expires_at)), repr(float(now)), self._ttl_ms, *_member(key),
                digest or b"", b"1" if start.handle_state == "evicted" else b""]
        async with self._op():
            return bool(await self._put_back(keys=[rkey], args=args))

    async def evict_handle(self, key: ConversationKey, turn: int) -> dict[str, Any] | None:
        rkey = conversation_key(key)
        async with self._op():
            handle = await self._evict_handle(keys=[rkey], args=[int(turn), repr(float(self._clock())), *_member(key)])
        return decode_handle(handle) if handle is not None else None

    async def get(self, key: ConversationKey) -> tuple[Conversation, dict[str, Any] | None, int] | None:
        rkey = conversation_key(key)
        async with self._op():
            record, handle, expires_at, finished, blocks, blocks_of = await self.client.hmget(
                rkey, ["record", "handle", "handle_expires_at", "finished", "blocks", "blocks_of"]
            )
        if record is None:
            return None
        live = handle is not None and float(expires_at or 0) > self._clock()
        written = blocks_of is not None and finished is not None and blocks_of.startswith(finished + b":")
        blocks = blocks if written else None          # as BLOCKS' blocks_of: else the record carries its own
        return _record(record, blocks), decode_handle(handle) if live else None, int(finished or 0)

    async def delete(self, key: ConversationKey) -> dict[str, Any] | None:
        rkey = conversation_key(key)
        async with self._op():
            self._known.drop(rkey)
            handle = await self._delete(keys=[rkey], args=[repr(float(self._clock())), *_member(key)])
        return decode_handle(handle) if handle is not None else None

    async def replicas(self, replica: str, now: float, ttl_s: float) -> int:
        async with self._op():
            return int(await self._replicas(keys=[REPLICAS_KEY], args=[
                replica, repr(float(now)), repr(float(now + ttl_s)), max(1, round(ttl_s * 1000))]))

    async def ping(self) -> bool:
        try:
            async with self._op():
                return bool(await self.client.ping())
        except StoreUnavailableError:
            return False

    async def close(self) -> None:
        with contextlib.suppress(RedisError, OSError):
            await self.client.aclose()


def _member(key: ConversationKey) -> tuple[str, str]:
    """(tenant prefix, session digest): what a script needs to file or unfile the conversation in the index."""
    return tenant_prefix(key.tenant), session_digest(key.session)


def _record(blob: bytes, blocks: bytes | int | None, known: tuple[str, bytes] | None = None) -> Conversation:
    """A stored record with its block hashes: kept beside it (`blocks`; 1: those `known` holds, the script found
    its tag stored) or, as an earlier layout wrote it, in it (None)."""
    record = decode_record(blob)
    if isinstance(blocks, int):
        if known is None:
            raise StoreUnavailableError("the store answered with block hashes this process does not hold")
        record.block_hashes = known[1]
    elif blocks is not None:
        record.block_hashes = blocks
    return record


def _begun(reply: list[Any], known: tuple[str, bytes] | None = None) -> TurnStart:
    """BEGIN_TURN's reply (also FIND_OR_BEGIN's second part) as a TurnStart."""
    turn, state, record, handle, expires_at, blocks = reply
    return TurnStart(
        turn=int(turn),
        record=_record(record, blocks, known) if record is not None else None,
        handle=decode_handle(handle) if handle is not None else None,
        handle_state=state.decode() if isinstance(state, bytes) else state,
        handle_expires_at=float(expires_at) if expires_at is not None else 0.0,
    )


def _holder(tenant: str, row: list[Any], now: float) -> Holder:
    blocks, session, finished, started, record, handle_expires_at, hashes = row
    state: HolderState
    if int(started) > int(finished):
        state = "in_flight"
    elif handle_expires_at is None:
        state = "none"
    else:
        state = "idle" if float(handle_expires_at) > now else "expired"
    key = ConversationKey(tenant, session.decode("utf-8", "surrogatepass"))
    return Holder(key, int(finished), int(blocks), _record(record, hashes), state)
