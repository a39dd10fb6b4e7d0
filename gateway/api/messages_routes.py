"""`POST /v1/messages`: Anthropic's Messages API over the chat turn (translation in messages.py, events in
message_events.py), its errors in Anthropic's shape: {"type": "error", "error": {"type", "message"}} (api/error_shapes.py
answers so on every `/v1/messages*` path).

The conversation is named as for chat (api/sessions.py: the session header, an agent's own header such as
Claude Code's X-Claude-Code-Session-Id, scoped by the system prompt), else found by its tokens.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
from litestar import Request, post
from litestar.di import NamedDependency
from litestar.types import ASGIApp

from gateway.api import messages as api
from gateway.api.message_events import MessageEvents
from gateway.api.schemas import ChatRequest, parse
from gateway.api.sessions import session_id
from gateway.api.turn_entry import Gateway, ModelRoute, TurnCall, dropped_tools, request_id, respond, run_turn
from gateway.turns.admin_actions import ConversationKey

_encode = msgspec.json.Encoder().encode
_decode = msgspec.json.Decoder().decode


@post("/v1/messages", status_code=200)
async def create_message(request: Request, gateway: NamedDependency[Gateway]) -> ASGIApp:
    arrived = time.perf_counter()
    tenant = gateway.api_keys.tenant_for(_authorization(request))
    req = api.parse_request(await request.body())
    route = gateway.route(req.model)
    tenant = route.scoped(tenant)
    body, parsed = _chat(req, route)
    settings = gateway.settings
    system = (api.system_text(req) or "").encode("utf-8", "surrogatepass")
    session = session_id(request.headers, {}, settings.session_header, settings.agent_session_headers, system,
                         body.get("tools") or (), settings.session_scope)
    key = ConversationKey(tenant, session) if session else None
    turn, reply = await run_turn(gateway, TurnCall(
        route, tenant, key, lambda: route.intake.chat(body, parsed, request_id(request)), arrived))
    dropped_tools(reply, api.hosted_tools(req))
    message_id = api.new_id()
    if reply.stream is not None:
        reply.stream = MessageEvents(message_id, turn.model, len(turn.prompt_ids),
                                     reply.cached_tokens).relay(reply.stream)
        return respond(reply, turn.clock)
    reply.body = _encode(api.from_completion(message_id, turn.model, _decode(reply.body or b"{}")))
    return respond(reply, turn.clock)


@post("/v1/messages/count_tokens", status_code=200)
async def count_tokens(request: Request, gateway: NamedDependency[Gateway]) -> dict[str, int]:
    """The request's prompt tokens as the turn would send them: translated and rendered with the model's chat
    template (tools included), nothing run. `max_tokens` is not part of this request (Anthropic's API)."""
    gateway.api_keys.tenant_for(_authorization(request))
    req = api.parse_request(await request.body(), counting=True)
    route = gateway.route(req.model)
    body, parsed = _chat(req, route)
    return {"input_tokens": len(route.intake.chat(body, parsed, request_id(request)).prompt_ids)}


MESSAGES_ROUTES = [create_message, count_tokens]


def _chat(req: api.MessagesRequest, route: ModelRoute) -> tuple[dict[str, Any], ChatRequest]:
    """The request as the chat body the turn runs (its model named as the gateway serves it)."""
    return parse(_encode(api.chat_body(req, route.intake.model_for(req.model) or None)), ChatRequest)


def _authorization(request: Request) -> str | None:
    """Anthropic's SDK sends its key as `x-api-key` (an auth token as `Authorization: Bearer`)."""
    key = request.headers.get("x-api-key")
    return f"Bearer {key}" if key else request.headers.get("authorization")
