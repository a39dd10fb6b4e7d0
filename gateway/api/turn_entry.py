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
from gateway.telemetry import Metrics
from gateway.turns.admin_actions import ConversationKey
from gateway.turns.intake.clock import TurnClock
from gateway.turns.intake.continued import Continuation
from gateway.turns.intake.intake import Intake
from gateway.turns.intake.request import TurnRequest
from gateway.turns.runner import TurnRunner
from gateway.turns.state.stored_responses import StoredResponses
from gateway.turns.run.turn import TurnReply

DROPPED_TOOLS = "X-PD-Dropped-Tools"
_REQUEST_ID = re.compile(r"[A-Za-z0-9_.:-]{1,96}")


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


@dataclass
class TurnCall:
    """A turn as an API hands it over: whose, which conversation (None: found by its tokens or stateless), and how
    its request is rendered (`render` runs while the conversation's store claim is in flight)."""
    tenant: str
    session: ConversationKey | None
    render: Callable[[], TurnRequest]
    arrived: float                      # perf_counter when the request arrived: the turn's clock starts there
    store_s: float = 0.0                # store reads the API made before (not intake: `pdgw_store_seconds` has them)


async def run_turn(gateway: Gateway, call: TurnCall) -> tuple[TurnRequest, TurnReply]:
    """Claim ahead, render, run. A turn refused meanwhile puts the claim back (turns/state/ahead.py)."""
    async with gateway.runner.claim_ahead(call.session) as ahead:
        turn = call.render()
        turn.clock = TurnClock(gateway.metrics.gateway_seconds, call.arrived)
        gateway.metrics.turn_seconds.labels("intake").observe(time.perf_counter() - call.arrived - call.store_s)
        reply = await gateway.runner.run(turn, call.session, call.tenant, ahead)
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
