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
from gateway.turns.intake.pieces import TokenIds
from gateway.turns.intake.request import TurnRequest
from gateway.turns.legs.capture import DecodeCapture
from gateway.turns.state.timing import timed

DEFAULT_IDS_TOKENS = 8_000_000          # token ids of recent responses kept in this process
log = logging.getLogger("gateway.responses")
_encode = msgspec.json.Encoder().encode


class ResponseStoreUnavailableError(UpstreamError):
    """The store did not answer: a response cannot be continued, fetched or deleted without it."""
    status = 503
    code = "store_unavailable"


class StoredResponses:
    def __init__(self, store: ConversationStore, metrics: Metrics, max_tokens: int = DEFAULT_IDS_TOKENS) -> None:
        self.store, self.metrics = store, metrics
        self._ids = _IdsCache(max_tokens)

    async def load(self, tenant: str, response_id: str) -> Previous:
        stored = await self._get(tenant, response_id, "previous_response_id")
        ids = self._ids.get((tenant, response_id))
        if ids is None and stored.ids:
            ids = TokenIds(array("q", stored.ids).tolist(), as_bytes=stored.ids)
            self._ids.put((tenant, response_id), ids)
        return Previous(response_id, stored.session, stored.model, ids, stored.messages or b"[]", stored.context)

    async def body(self, tenant: str, response_id: str) -> bytes:
        return (await self._get(tenant, response_id, "response_id")).body

    async def delete(self, tenant: str, response_id: str) -> None:
        _check_id(response_id, "response_id")
        self._ids.pop((tenant, response_id))
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
        answer = _encode(_assistant(capture))
        stored = StoredResponse(session=session, model=req.model, ids=ids.as_bytes if ids is not None else b"",
                                messages=b"[" + b",".join(p for p in (thread.history, answer) if p) + b"]",
                                context=thread.context, body=body, created_at=time.time())
        try:
            await timed(self.metrics, "put_response", self.store.put_response(tenant, response_id, stored))
        except StoreUnavailableError as exc:
            log.warning("response %s not stored: %s", response_id, exc)
            return False
        if ids is not None:
            self._ids.put((tenant, response_id), ids)
        return True

    async def _get(self, tenant: str, response_id: str, param: str) -> StoredResponse:
        _check_id(response_id, param)
        try:
            stored = await timed(self.metrics, "get_response", self.store.get_response(tenant, response_id))
        except StoreUnavailableError:
            raise ResponseStoreUnavailableError("the conversation store is unavailable") from None
        if stored is None:
            self._ids.pop((tenant, response_id))
            raise _not_found(response_id, param)
        return stored


def _held(req: TurnRequest, capture: DecodeCapture | None) -> TokenIds | None:
    """D's tokens after the turn, prompt + output as D reported them; None when D did not say."""
    if capture is None or capture.prompt_ids is None or not capture.output_ids_seen or not capture.finished:
        return None
    prompt = capture.prompt_ids
    if prompt is not req.prompt_ids:
        prompt = req.prompt_ids if len(prompt) == len(req.prompt_ids) and prompt == req.prompt_ids \
            else TokenIds(prompt)
    return TokenIds.joined([prompt, capture.output_ids])


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


class _IdsCache:
    """(tenant, response id) → its TokenIds, least recently used out first beyond `max_tokens` ids."""

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._entries: OrderedDict[tuple[str, str], TokenIds] = OrderedDict()
        self._tokens = 0

    def get(self, key: tuple[str, str]) -> TokenIds | None:
        ids = self._entries.get(key)
        if ids is not None:
            self._entries.move_to_end(key)
        return ids

    def put(self, key: tuple[str, str], ids: TokenIds) -> None:
        self.pop(key)
        if len(ids) > self.max_tokens:
            return
        self._entries[key] = ids
        self._tokens += len(ids)
        while self._tokens > self.max_tokens:
            _, old = self._entries.popitem(last=False)
            self._tokens -= len(old)

    def pop(self, key: tuple[str, str]) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self._tokens -= len(old)
