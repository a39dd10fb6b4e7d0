"""Stored Responses API responses, through the store: loaded (within the caller's tenant) for a turn that
continues `previous_response_id`, saved once D has answered with the exact ids D then holds, fetched and deleted
for `GET` / `DELETE /v1/responses/{id}`.

A stored response keeps D's ids (prompt + output, int64 little-endian: the bytes continuity hashes already), the
conversation's chat messages (for the engines, which still get the whole conversation, and for a turn that must
render it whole), the digest of its instructions and tools, and the response object its client got. Recent
responses' ids are also kept in this process as they were joined (`_IdsCache`), so the turn that continues one
copies the references of its ids instead of decoding them; the store's copy is what another replica, or this one
after eviction, reads. The response itself is the store's: a deleted or expired response is not continued from
the cache either (`load` reads the store first).
"""

from __future__ import annotations

import logging
import time
from array import array
from collections import OrderedDict
from typing import Any

import msgspec

from gateway.errors import NotFoundError, UpstreamError
from gateway.store import ConversationStore, StoredResponse, StoreUnavailableError, check_response_id
from gateway.telemetry import Metrics
from gateway.turns.intake.continued import Previous, Thread
from gateway.turns.intake.pieces import HeldIds, TokenIds
from gateway.turns.intake.request import TurnRequest
from gateway.turns.legs.capture import DecodeCapture
from gateway.turns.state.timing import timed

DEFAULT_IDS_TOKENS = 4_000_000          # token ids of recent responses kept in this process (lists: the collector
                                        # scans them on full collections, so not unbounded)
log = logging.getLogger("gateway.responses")
_encode = msgspec.json.Encoder().encode


class ResponseStoreUnavailableError(UpstreamError):
    """The store did not answer: a response cannot be continued, fetched or deleted without it."""
    status = 503
    code = "store_unavailable"


class StoredResponses:
    def __init__(self, store: ConversationStore, metrics: Metrics, max_tokens: int = DEFAULT_IDS_TOKENS) -> None:
        self.store, self.metrics = store, metrics
        self._chains = _Chains(max_tokens)

    async def load(self, tenant: str, response_id: str) -> Previous:
        """The response to continue. Kept in this process: only its small fields are read, to know it still
        exists in the store; else all of it, and it is kept from now on."""
        key = (tenant, response_id)
        chain = self._chains.get(key)
        stored = await self._get(tenant, response_id, "previous_response_id", bulk=chain is None)
        if chain is None:
            ids = HeldIds(TokenIds(array("q", stored.ids).tolist(), as_bytes=stored.ids)) if stored.ids else None
            chain = _Chain(ids, (stored.messages[1:-1],) if len(stored.messages) > 2 else ())
            self._chains.put(key, chain)
        return Previous(response_id, stored.session, stored.model, chain.ids, chain.history, stored.context)

    async def body(self, tenant: str, response_id: str) -> bytes:
        return (await self._get(tenant, response_id, "response_id", bulk=True)).body

    async def delete(self, tenant: str, response_id: str) -> None:
        _check_id(response_id, "response_id")
        self._chains.pop((tenant, response_id))
        try:
            deleted = await timed(self.metrics, "delete_response", self.store.delete_response(tenant, response_id))
        except StoreUnavailableError:
            raise ResponseStoreUnavailableError("the conversation store is unavailable") from None
        if not deleted:
            raise _not_found(response_id, "response_id")

    async def save(self, tenant: str, response_id: str, session: str, req: TurnRequest, thread: Thread,
                   capture: DecodeCapture | None, body: bytes) -> bool:
        """Keep the response with what its next turn needs; False when the store did not take it (a later
        `previous_response_id` on it is then unknown: the client gets a 404, never a wrong conversation)."""
        ids = _held(req, capture)
        history = (*thread.history, _encode(_assistant(capture)))
        stored = StoredResponse(session=session, model=req.model, ids=ids.as_bytes if ids is not None else b"",
                                messages=b"[" + b",".join(history) + b"]", context=thread.context, body=body,
                                created_at=time.time())
        try:
            await timed(self.metrics, "put_response", self.store.put_response(tenant, response_id, stored))
        except StoreUnavailableError as exc:
            log.warning("response %s not stored: %s", response_id, exc)
            return False
        self._chains.put((tenant, response_id), _Chain(HeldIds(ids) if ids is not None else None, history))
        return True

    async def _get(self, tenant: str, response_id: str, param: str, bulk: bool) -> StoredResponse:
        _check_id(response_id, param)
        try:
            stored = await timed(self.metrics, "get_response", self.store.get_response(tenant, response_id, bulk))
        except StoreUnavailableError:
            raise ResponseStoreUnavailableError("the conversation store is unavailable") from None
        if stored is None:
            self._chains.pop((tenant, response_id))
            raise _not_found(response_id, param)
        return stored


def _held(req: TurnRequest, capture: DecodeCapture | None) -> TokenIds | None:
    """D's tokens after the turn, prompt + output as D reported them; None when D did not say. The turn is over
    (its answer recorded, its legs closed): its prompt's list becomes the chain's and grows by D's output in
    place, so a chain keeps one list of its ids, not one per response (`HeldIds`)."""
    if capture is None or capture.prompt_ids is None or not capture.output_ids_seen or not capture.finished:
        return None
    prompt, output = capture.prompt_ids, TokenIds(capture.output_ids)
    if prompt is req.prompt_ids or (len(prompt) == len(req.prompt_ids) and prompt == req.prompt_ids):
        if isinstance(req.prompt_ids, TokenIds):
            req.prompt_ids.extend_pieces(output)
            return req.prompt_ids
    return TokenIds.joined([prompt, output])


def _assistant(capture: DecodeCapture | None) -> dict[str, Any]:
    """D's answer as the chat message a later turn renders, should it be rendered whole."""
    text = "".join(capture.text) if capture else ""
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    calls = [{"id": c.get("id"), "type": "function", "function": c["function"]} for c in (capture.tool_calls if capture else ())]
    if calls:
        message["tool_calls"] = calls
    return message


def _check_id(response_id: str, param: str) -> None:
    try:
        check_response_id(response_id)
    except ValueError:
        raise _not_found(response_id, param) from None


def _not_found(response_id: str, param: str) -> NotFoundError:
    shown = response_id if isinstance(response_id, str) and len(response_id) <= 128 else "(invalid)"
    return NotFoundError(f"Response with id '{shown}' not found.", param=param)


class _Chain:
    """What a continued turn takes from a response kept in this process: D's ids and the messages' parts."""
    __slots__ = ("ids", "history", "size")

    def __init__(self, ids: HeldIds | None, history: tuple[bytes, ...]) -> None:
        self.ids, self.history = ids, history
        self.size = (len(ids) if ids is not None else 0) + sum(map(len, history)) // 8     # in token-id units


class _Chains:
    """(tenant, response id) → its _Chain, least recently used out first beyond `max_tokens` (ids, and message
    bytes counted 8 to an id)."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._entries: OrderedDict[tuple[str, str], _Chain] = OrderedDict()
        self._tokens = 0

    def get(self, key: tuple[str, str]) -> _Chain | None:
        chain = self._entries.get(key)
        if chain is not None:
            self._entries.move_to_end(key)
        return chain

    def put(self, key: tuple[str, str], chain: _Chain) -> None:
        self.pop(key)
        if chain.size > self.max_tokens:
            return
        self._entries[key] = chain
        self._tokens += chain.size
        while self._tokens > self.max_tokens:
            _, old = self._entries.popitem(last=False)
            self._tokens -= old.size

    def pop(self, key: tuple[str, str]) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self._tokens -= old.size
