"""An engine that refuses one request for what the request is (vLLM's 4xx: too long, bad ids) stays in
rotation for everyone; the client gets the 400. A 5xx counts once toward the breaker, which ejects only after
several in a row. Real HTTP on loopback, the gateway's own client and call accounting."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from aiohttp import web

from gateway.engines.client import EngineClient
from gateway.engines.engine import FAILURES_TO_EJECT, Engine
from gateway.errors import InvalidRequestError, UpstreamError
from gateway.telemetry import Metrics
from gateway.turns.legs.calls import EngineCalls

TOO_LONG = {"error": {"message": "This model's maximum context length is 64 tokens. However, your request has "
                                 "99 input tokens. Please reduce the length of the input messages.",
                      "type": "BadRequestError", "param": None, "code": 400}}


async def blamed(status: int) -> tuple[type[Exception], Engine]:
    async def answer(_: web.Request) -> web.Response:
        return web.json_response(TOO_LONG if status == 400 else {"error": "boom"}, status=status)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    engine, raised = Engine(url, "prefill"), Exception
    try:
        async with aiohttp.ClientSession() as session:
            client = EngineClient(session)
            try:
                await EngineCalls(Metrics()).call(engine, client.post_json(url, "/v1/chat/completions", {},
                                                                           timeout_s=5))
            except Exception as exc:  # the error class is what the test looks at
                raised = type(exc)
    finally:
        await runner.cleanup()
    return raised, engine


@pytest.mark.parametrize(("status", "error", "failures"), [(400, InvalidRequestError, 0), (500, UpstreamError, 1)])
def test_what_an_engine_error_costs_the_engine(status, error, failures):
    raised, engine = asyncio.run(blamed(status))
    assert issubclass(raised, error)
    assert engine.breaker.failures == failures < FAILURES_TO_EJECT
    assert engine.available(time.monotonic())          # still in rotation
