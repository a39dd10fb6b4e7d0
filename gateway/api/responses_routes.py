"""`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`: OpenAI's Responses API over the chat turn.

A response is stored (unless `store: false`) in its tenant with what its next turn needs; a turn with
`previous_response_id` continues that conversation's exact token ids (turns/intake/continued.py) in the store's
conversation of the response chain, so it reuses D's KV like a chat turn. A new chain's conversation is the one
an agent harness's session header names, else none: it is found by its tokens (the prefix index), as a chat turn
without a session id, so a client that resends the whole input without `previous_response_id` (openai-agents'
default Runner) reuses D's KV; the chain continues in the conversation found or begun. Under
`--conversation-lookup session` the chain's first response id names it instead. Two turns on one previous id are two branches of one conversation: one claims
D's handle, the other is planned against what D holds (partial or full), as any concurrent chat turn.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, TypeVar

import msgspec
from litestar import Request, Response, delete, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath
from litestar.types import ASGIApp

from gateway.api import responses as api
from gateway.api.response_events import ResponseEvents
from gateway.api.schemas import ChatRequest, parse
from gateway.api.sessions import session_id
from gateway.api.turn_entry import Gateway, TurnCall, dropped_tools, request_id, respond, run_turn
from gateway.errors import NotFoundError
from gateway.turns.admin_actions import ConversationKey
from gateway.turns.intake.continued import Previous, Thread
from gateway.turns.intake.request import TurnRequest

T = TypeVar("T")
_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


@post("/v1/responses", status_code=200)
async def create_response(request: Request, gateway: NamedDependency[Gateway]) -> ASGIApp:
    arrived = time.perf_counter()
    tenant = gateway.api_keys.tenant_for(request.headers.get("authorization"))
    req = api.parse_request(await request.body())
    route = gateway.route(req.model)
    tenant = route.scoped(tenant)       # a response id names a response of this model only
    model = route.intake.model_for(req.model)
    previous: Previous | None = None
    loading = time.perf_counter()
    if req.previous_response_id is not None:
        previous = await gateway.responses.load(tenant, req.previous_response_id)
    store_s = time.perf_counter() - loading          # `get_response` in pdgw_store_seconds, not intake
    body, parsed = parse(_encode(api.chat_body(req, model or None)), ChatRequest)
    response_id = api.new_id("resp")
    session = previous.session if previous is not None else _new_session(request, gateway, req, body, response_id)
    key = ConversationKey(tenant, session) if session else None
    captured: list[Any] = []
    thread: Thread | None = None          # rendering says how the turn continues the chain

    def render() -> TurnRequest:
        nonlocal thread
        turn, thread = route.continuation.turn(previous, req.instructions, body, parsed, request_id(request))
        turn.on_recorded = captured.append
        return turn

    turn, reply = await run_turn(gateway, TurnCall(route, tenant, key, render, arrived, store_s))
    dropped_tools(reply, api.hosted_tools(req.tools))
    if key is None and reply.session is not None and req.store is not False:
        session = reply.session.session       # found by its tokens (or new): the chain continues there
    assert thread is not None
    answer = _Answer(gateway, tenant, response_id, session, req, turn, thread, captured)
    if reply.stream is not None:
        reply.stream = answer.events(reply.stream)
        return respond(reply, turn.clock)
    reply.body = await answer.json(_decode(reply.body or b"{}"))
    return respond(reply, turn.clock)


@get("/v1/responses/{response_id:str}")
async def get_response(request: Request, response_id: FromPath[str], gateway: NamedDependency[Gateway]) -> Response:
    tenant = gateway.api_keys.tenant_for(request.headers.get("authorization"))
    body = await _in_any_model(gateway, tenant, lambda scoped: gateway.responses.body(scoped, response_id))
    return Response(body, media_type="application/json")


@delete("/v1/responses/{response_id:str}", status_code=200)
async def delete_response(request: Request, response_id: FromPath[str], gateway: NamedDependency[Gateway]) -> dict[str, Any]:
    tenant = gateway.api_keys.tenant_for(request.headers.get("authorization"))
    await _in_any_model(gateway, tenant, lambda scoped: gateway.responses.delete(scoped, response_id))
    return {"id": response_id, "object": "response", "deleted": True}


RESPONSES_ROUTES = [create_response, get_response, delete_response]


async def _in_any_model(gateway: Gateway, tenant: str, act: Callable[[str], Awaitable[T]]) -> T:
    """A response id names no model: each model's scope is tried (one model: the tenant's own)."""
    for route in gateway.routes[:-1]:
        try:
            return await act(route.scoped(tenant))
        except NotFoundError:
            continue
    return await act(gateway.routes[-1].scoped(tenant))


def _new_session(request: Request, gateway: Gateway, req: api.ResponsesRequest, body: dict[str, Any],
                 response_id: str) -> str | None:
    settings = gateway.settings
    system = (req.instructions or "").encode("utf-8", "surrogatepass")
    given = session_id(request.headers, {}, settings.session_header, settings.agent_session_headers, system,
                       body.get("tools") or (), settings.session_scope)
    if given or req.store is False or settings.conversation_lookup != "session":
        return given      # none: found by its tokens, as a chat turn without a session id (openai-agents' Runner)
    return response_id


class _Answer:
    """D's chat answer as a response: the object (JSON) or its events (stream), stored once D has answered."""

    def __init__(self, gateway: Gateway, tenant: str, response_id: str, session: str | None,
                 req: api.ResponsesRequest, turn: TurnRequest, thread: Thread, captured: list[Any]) -> None:
        self.gateway, self.tenant, self.response_id, self.session = gateway, tenant, response_id, session
        self.req, self.turn, self.thread, self.captured = req, turn, thread, captured
        self.created_at = int(time.time())

    async def json(self, completion: dict[str, Any]) -> bytes:
        body = _encode(api.from_completion(self.response_id, self.req, self.turn.model, completion, self.created_at))
        await self._store(body)
        return body

    def events(self, chat: AsyncGenerator[bytes, None]) -> AsyncGenerator[bytes, None]:
        start = api.response(self.response_id, self.req, self.turn.model, status="in_progress", output=[],
                             created_at=self.created_at)
        return ResponseEvents(start, self._finish).relay(chat)

    async def _finish(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
                      finish_reason: str | None, error: dict[str, Any] | None) -> dict[str, Any]:
        final = api.response(self.response_id, self.req, self.turn.model, status=status, output=output,
                             usage_=usage, finish_reason=finish_reason, error=error, created_at=self.created_at)
        if status != "failed":
            await self._store(_encode(final))
        return final

    async def _store(self, body: bytes) -> None:
        if self.req.store is False or self.session is None:
            return
        capture = self.captured[0] if self.captured else None
        await self.gateway.responses.save(self.tenant, self.response_id, self.session, self.turn, self.thread,
                                          capture, body)
