"""The one entry every client API runs a turn through. Each API's handlers authenticate, parse and translate
their request into a chat body and name the conversation (a `TurnCall`); `run_turn` then claims the conversation
ahead, renders, times and runs the turn, and `respond` hands the reply to the server. A new API is a translation
module and its routes (docs/architecture.md, "Where each kind of change goes")."""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from litestar import Request
from litestar.response.base import ASGIResponse
from litestar.types import ASGIApp, Receive, Scope, Send

from gateway.api.auth import ApiKeys
from gateway.api.events import EventStream
from gateway.config import Settings
from gateway.errors import ModelNotFoundError
from gateway.telemetry import Metrics
from gateway.turns.admin_actions import ConversationAdmin, ConversationKey, EngineAdmin
from gateway.turns.intake.clock import TurnClock
from gateway.turns.intake.continued import Continuation
from gateway.turns.intake.intake import Intake
from gateway.turns.intake.request import TurnRequest
from gateway.turns.runner import TurnRunner
from gateway.turns.state.stored_responses import StoredResponses
from gateway.turns.run.turn import TurnReply

DROPPED_TOOLS = "X-PD-Dropped-Tools"
_REQUEST_ID = re.compile(r"[A-Za-z0-9_.:-]{1,96}")


@dataclass(frozen=True)
class ModelRoute:
    """One served model as a turn needs it: its intake (tokenizer, template, context length), its runner (engines,
    transfer protocol, pins), the Responses API's continuation, and the scope its conversations are kept in."""
    intake: Intake
    runner: TurnRunner
    continuation: Continuation
    conversations: ConversationAdmin    # what the admin API does to its conversations and engines
    fleet: EngineAdmin
    scope: str | None = None            # None: the tenant's own (one model served)
    aliases: tuple[str, ...] = ()

    def scoped(self, tenant: str) -> str:
        """The tenant as this model's conversations, pins and stored responses are kept under."""
        return tenant if self.scope is None else f"{tenant}.{self.scope}"


class Gateway:
    """What a turn's handler needs, given as one dependency: a turn is the hot path, and Litestar resolves one
    dependency per request faster than five."""

    __slots__ = ("api_keys", "metrics", "settings", "responses", "routes", "_by_name")

    def __init__(self, api_keys: ApiKeys, metrics: Metrics, settings: Settings, routes: list[ModelRoute],
                 responses: StoredResponses | None = None) -> None:
        self.api_keys, self.metrics, self.settings = api_keys, metrics, settings
        self.responses = responses          # the Responses API's stored responses (responses_routes.py)
        self.set_routes(routes)

    def set_routes(self, routes: list[ModelRoute]) -> None:
        """The models served from now on (a reload added or took out some); a turn already routed keeps its own."""
        self.routes, self._by_name = routes, {name: r for r in routes for name in (*r.intake.served_models, *r.aliases)}

    def route(self, model: str | None) -> ModelRoute:
        """The model a request names (or an alias of it); none named: the first served. One model served: its
        intake decides (an unknown name is its 404)."""
        if model is None or len(self.routes) == 1:
            return self.routes[0]
        found = self._by_name.get(model)
        if found is None:
            raise ModelNotFoundError(f"The model `{model}` does not exist.", param="model")
        return found

    @property
    def served(self) -> list[str]:
        """Every name a request may give, as /v1/models lists them."""
        return list(self._by_name)


@dataclass
class TurnCall:
    """A turn as an API hands it over: its model's route, whose (the tenant in the model's scope), which
    conversation (None: found by its tokens or stateless), and how its request is rendered (`render` runs while
    the conversation's store claim is in flight)."""
    route: ModelRoute
    tenant: str
    session: ConversationKey | None
    render: Callable[[], TurnRequest]
    arrived: float                      # perf_counter when the request arrived: the turn's clock starts there
    store_s: float = 0.0                # store reads the API made before (not intake: `pdgw_store_seconds` has them)


async def run_turn(gateway: Gateway, call: TurnCall) -> tuple[TurnRequest, TurnReply]:
    """Claim ahead, render, run. A turn refused meanwhile puts the claim back (turns/state/ahead.py)."""
    runner = call.route.runner
    async with runner.claim_ahead(call.session) as ahead:
        turn = call.render()
        turn.clock = TurnClock(gateway.metrics.gateway_seconds, call.arrived)
        runner.metrics.turn_seconds.labels("intake").observe(time.perf_counter() - call.arrived - call.store_s)
        reply = await runner.run(turn, call.session, call.tenant, ahead)
    if call.session is not None and gateway.settings.pd_headers:
        # the conversation's id as the store and the admin API know it (a session id scoped by its head)
        reply.headers["X-PD-Session"] = call.session.session
    return turn, reply


def dropped_tools(reply: TurnReply, dropped: list[str]) -> None:
    """Hosted tools the engines cannot run, left out of the turn: named in a header instead of a 400."""
    if dropped:
        reply.headers[DROPPED_TOOLS] = ",".join(dict.fromkeys(dropped))


def request_id(request: Request) -> str:
    given = request.headers.get("x-request-id")
    return given if given and _REQUEST_ID.fullmatch(given) else uuid.uuid4().hex


def respond(reply: TurnReply, clock: TurnClock) -> ASGIApp:
    """Turns answer with ASGI responses of their own: Litestar hands them to the server as they are."""
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
