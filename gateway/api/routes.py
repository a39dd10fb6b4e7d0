"""HTTP surface: OpenAI chat/completions, models, health, readiness, metrics. Thin: parse, delegate, shape."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from litestar.di import NamedDependency
from litestar import Request, Response, get, post
from litestar.response.base import ASGIResponse
from litestar.types import ASGIApp, Receive, Scope, Send

from gateway.api import operational
from gateway.api.auth import ApiKeys
from gateway.api.events import EventStream
from gateway.api.openapi import openapi_json
from gateway.api.schemas import ChatRequest, CompletionRequest, parse
from gateway.api.sessions import session_id
from gateway.api.validation import check_stop
from gateway.config import Settings
from gateway.telemetry import Metrics
from gateway.turns.intake.clock import TurnClock
from gateway.turns.admin_actions import ConversationKey
from gateway.turns.intake.continued import Continuation
from gateway.turns.intake.intake import Intake
from gateway.turns.intake.request import TurnRequest
from gateway.turns.runner import TurnRunner
from gateway.turns.state.stored_responses import StoredResponses
from gateway.turns.turn import TurnReply

Readiness = Callable[[], Awaitable[dict[str, Any]]]

_REQUEST_ID = re.compile(r"[A-Za-z0-9_.:-]{1,96}")


# Turns answer with ASGI responses of their own (`_respond`): Litestar hands them to the server as they are.
@post("/v1/chat/completions", status_code=200)
async def chat_completions(request: Request, gateway: NamedDependency[Gateway]) -> ASGIApp:
    return await _turn(request, gateway, ChatRequest, gateway.intake.chat)


@post("/v1/completions", status_code=200)
async def completions(request: Request, gateway: NamedDependency[Gateway]) -> ASGIApp:
    return await _turn(request, gateway, CompletionRequest, gateway.intake.completion)


@get("/v1/models")
async def models(request: Request, api_keys: NamedDependency[ApiKeys],
                 intake: NamedDependency[Intake]) -> dict[str, Any]:
    api_keys.tenant_for(request.headers.get("authorization"))
    return {"object": "list", "data": [
        {"id": name, "object": "model", "owned_by": "pd-gateway"} for name in intake.served_models]}


@get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@get("/ready")
async def ready(readiness: NamedDependency[Readiness]) -> Response:
    report = await readiness()
    return Response(report, status_code=200 if report["ready"] else 503)


@get("/metrics", media_type="text/plain; version=0.0.4")
async def metrics(request: Request, metrics: NamedDependency[Metrics], settings: NamedDependency[Settings],
                  api_keys: NamedDependency[ApiKeys]) -> bytes:
    operational.authorize(request, settings, api_keys)
    return metrics.render()


class Gateway:
    """What a turn's handler needs, given as one dependency: a turn is the hot path, and Litestar resolves one
    dependency per request faster than five."""

    __slots__ = ("api_keys", "intake", "metrics", "runner", "settings", "responses", "continuation")

    def __init__(self, api_keys: ApiKeys, intake: Intake, metrics: Metrics, runner: TurnRunner,
                 settings: Settings, responses: StoredResponses | None = None,
                 continuation: Continuation | None = None) -> None:
        self.api_keys, self.intake, self.metrics, self.runner, self.settings = \
            api_keys, intake, metrics, runner, settings
        self.responses, self.continuation = responses, continuation      # the Responses API (responses_routes.py)


ROUTES = [chat_completions, completions, models, health, ready, metrics, openapi_json]


async def _turn(request: Request, gateway: Gateway, schema: type, intake: Callable[..., TurnRequest]) -> ASGIApp:
    """Authenticate, validate, render, run: the same for chat and completions. A session turn's store claim
    is sent before rendering and overlaps it; a turn refused meanwhile puts it back (turns/state/state.py)."""
    began = time.perf_counter()
    tenant = gateway.api_keys.tenant_for(request.headers.get("authorization"))
    body, parsed = parse(await request.body(), schema)
    check_stop(body)
    session = _session(request, body, gateway.settings, tenant)
    async with gateway.runner.claim_ahead(session) as ahead:
        turn = intake(body, parsed, _request_id(request))
        turn.clock = TurnClock(gateway.metrics.gateway_seconds, began)
        gateway.metrics.turn_seconds.labels("intake").observe(time.perf_counter() - began)
        reply = await gateway.runner.run(turn, session, tenant, ahead)
    named_session(reply, session, gateway.settings)
    return _respond(reply, turn.clock)


DROPPED_TOOLS = "X-PD-Dropped-Tools"


def named_session(reply: TurnReply, session: ConversationKey | None, settings: Settings) -> None:
    """The conversation's id as the store and the admin API know it (a session id scoped by its head)."""
    if session is not None and settings.pd_headers:
        reply.headers["X-PD-Session"] = session.session


def dropped_tools(reply: TurnReply, dropped: list[str]) -> None:
    """Hosted tools the engines cannot run, left out of the turn: named in a header instead of a 400."""
    if dropped:
        reply.headers[DROPPED_TOOLS] = ",".join(dict.fromkeys(dropped))


def _respond(reply: TurnReply, clock: TurnClock) -> ASGIApp:
    if reply.stream is not None:
        return EventStream(reply.stream, reply.headers, on_first_frame=clock.delivered)
    return _Delivered(ASGIResponse(body=reply.body or b"", media_type="application/json", headers=reply.headers,
                                   status_code=200), clock)


class _Delivered:
    """A JSON answer that marks the turn's clock once its bytes are handed to the server."""

    __slots__ = ("_clock", "_response")

    def __init__(self, response: ASGIResponse, clock: TurnClock) -> None:
        self._response, self._clock = response, clock

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._response(scope, receive, send)
        self._clock.delivered()


def _request_id(request: Request) -> str:
    given = request.headers.get("x-request-id")
    return given if given and _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex


def _session(request: Request, body: dict[str, Any], settings: Settings, tenant: str) -> ConversationKey | None:
    """Header first (name configurable), then an agent harness's header, else body `conversation_id` /
    `session_id` (api/sessions.py), within the caller's tenant: the same session id under another API key is
    another conversation. None: stateless."""
    session = session_id(request.headers, body, settings.session_header, settings.agent_session_headers,
                         scope=settings.session_scope)
    return None if session is None else ConversationKey(tenant, session)
