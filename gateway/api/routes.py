"""HTTP surface: OpenAI chat/completions, models, health, readiness, metrics. Thin: parse, delegate, shape."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from litestar.di import NamedDependency
from litestar import Request, Response, get, post
from litestar.types import ASGIApp

from gateway.api import operational
from gateway.api.auth import ApiKeys
from gateway.api.openapi import openapi_json
from gateway.api.schemas import ChatRequest, CompletionRequest, parse
from gateway.api.sessions import session_id
from gateway.api.turn_entry import Gateway, TurnCall, request_id, respond, run_turn
from gateway.api.validation import check_stop
from gateway.config import Settings
from gateway.telemetry import Metrics, worker_index
from gateway.turns.admin_actions import ConversationKey
from gateway.turns.intake.intake import Intake
from gateway.turns.intake.request import TurnRequest

Readiness = Callable[[], Awaitable[dict[str, Any]]]


@post("/v1/chat/completions", status_code=200)
async def chat_completions(request: Request, gateway: NamedDependency[Gateway]) -> ASGIApp:
    return await _turn(request, gateway, ChatRequest, Intake.chat)


@post("/v1/completions", status_code=200)
async def completions(request: Request, gateway: NamedDependency[Gateway]) -> ASGIApp:
    return await _turn(request, gateway, CompletionRequest, Intake.completion)


@get("/v1/models")
async def models(request: Request, gateway: NamedDependency[Gateway]) -> dict[str, Any]:
    gateway.api_keys.tenant_for(request.headers.get("authorization"))
    return {"object": "list", "data": [
        {"id": name, "object": "model", "owned_by": "pd-gateway"} for name in gateway.served]}


# Under `serve --workers N` it says which worker answered (each connection stays with one).
_HEALTH: dict[str, object] = {"status": "ok"} | ({"worker": i} if (i := worker_index()) is not None else {})


@get("/health")
async def health() -> dict[str, object]:
    return _HEALTH


@get("/ready")
async def ready(readiness: NamedDependency[Readiness]) -> Response:
    report = await readiness()
    return Response(report, status_code=200 if report["ready"] else 503)


@get("/metrics", media_type="text/plain; version=0.0.4")
async def metrics(request: Request, metrics: NamedDependency[Metrics], settings: NamedDependency[Settings],
                  api_keys: NamedDependency[ApiKeys]) -> bytes:
    operational.authorize(request, settings, api_keys)
    return metrics.render()


ROUTES = [chat_completions, completions, models, health, ready, metrics, openapi_json]


async def _turn(request: Request, gateway: Gateway, schema: type, intake: Callable[..., TurnRequest]) -> ASGIApp:
    """Authenticate, validate, find the model, name the conversation, run: the same for chat and completions."""
    arrived = time.perf_counter()
    tenant = gateway.api_keys.tenant_for(request.headers.get("authorization"))
    body, parsed = parse(await request.body(), schema)
    check_stop(body)
    route = gateway.route(parsed.model)
    tenant = route.scoped(tenant)
    session = _session(request, body, gateway.settings, tenant)
    turn, reply = await run_turn(gateway, TurnCall(
        route, tenant, session, lambda: intake(route.intake, body, parsed, request_id(request)), arrived))
    return respond(reply, turn.clock)


def _session(request: Request, body: dict[str, Any], settings: Settings, tenant: str) -> ConversationKey | None:
    """Header first (name configurable), then an agent harness's header, else body `conversation_id` /
    `session_id` (api/sessions.py), within the caller's tenant: the same session id under another API key is
    another conversation. None: stateless."""
    session = session_id(request.headers, body, settings.session_header, settings.agent_session_headers,
                         scope=settings.session_scope)
    return None if session is None else ConversationKey(tenant, session)
