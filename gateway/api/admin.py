"""Admin API: conversations and engines. Off unless an admin key is configured; the key is compared in
constant time."""

from __future__ import annotations

import hmac
from typing import Any, Literal
from urllib.parse import urlsplit

import msgspec
from litestar.di import NamedDependency
from litestar import Request, Response, delete, get, post
from litestar.params import FromPath, FromQuery, JSONBody

from gateway.config import DEFAULT_TENANT, Settings
from gateway.errors import AuthenticationError, InvalidRequestError, NotFoundError
from gateway.api.turn_entry import Gateway
from gateway.turns.admin_actions import ConversationKey


def _authorize(request: Request, settings: Settings) -> None:
    key = settings.admin_key
    given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
    if not key or not hmac.compare_digest(given.encode(), key.encode()):
        raise AuthenticationError("a valid admin key is required")


@get("/admin/conversations/{session_id:str}")
async def get_conversation(session_id: FromPath[str], request: Request, settings: NamedDependency[Settings],
                           gateway: NamedDependency[Gateway], tenant: FromQuery[str] = DEFAULT_TENANT,
                           model: FromQuery[str | None] = None) -> dict[str, Any]:
    _authorize(request, settings)
    route = gateway.route(model)
    found = await route.conversations.describe(ConversationKey(route.scoped(tenant), session_id))
    if found is None:
        raise NotFoundError("no such conversation")
    return found


@delete("/admin/conversations/{session_id:str}", status_code=200)
async def delete_conversation(session_id: FromPath[str], request: Request, settings: NamedDependency[Settings],
                              gateway: NamedDependency[Gateway], tenant: FromQuery[str] = DEFAULT_TENANT,
                              model: FromQuery[str | None] = None) -> Response:
    _authorize(request, settings)
    route = gateway.route(model)
    if not await route.conversations.delete(ConversationKey(route.scoped(tenant), session_id)):
        raise NotFoundError("no such conversation")
    return Response({"deleted": session_id})


@get("/admin/engines")
async def engines(request: Request, settings: NamedDependency[Settings],
                  gateway: NamedDependency[Gateway]) -> dict[str, Any]:
    _authorize(request, settings)
    return {"engines": [{**engine, "model": route.intake.served_models[0] if route.intake.served_models else None}
                        for route in gateway.routes for engine in route.fleet.describe()]}


class EngineChange(msgspec.Struct):
    role: Literal["prefill", "decode"]
    url: str
    model: str | None = None            # several models served: whose engine (none: the first's)


@post("/admin/engines", status_code=201)
async def add_engine(data: JSONBody[EngineChange], request: Request, settings: NamedDependency[Settings],
                     gateway: NamedDependency[Gateway]) -> dict[str, Any]:
    _authorize(request, settings)
    if urlsplit(data.url).scheme not in ("http", "https"):
        raise InvalidRequestError("url must be an http(s) URL", param="url")
    return await gateway.route(data.model).fleet.add(data.role, data.url)


@delete("/admin/engines", status_code=200)
async def remove_engine(role: FromQuery[Literal["prefill", "decode"]], url: FromQuery[str], request: Request,
                        settings: NamedDependency[Settings], gateway: NamedDependency[Gateway],
                        model: FromQuery[str | None] = None) -> dict[str, Any]:
    _authorize(request, settings)
    if not gateway.route(model).fleet.remove(role, url):
        raise NotFoundError("no such engine")
    return {"removed": url}


ADMIN_ROUTES = [get_conversation, delete_conversation, engines, add_engine, remove_engine]
