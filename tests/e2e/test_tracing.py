"""Tracing on, against an in-memory exporter: the app in-process (Litestar's test client), simulated P and D as
real processes behind recording proxies. A turn span per turn and a span per leg carry plan, reason and
token counts; the client's trace is continued; each leg's request carries that leg's traceparent."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import subprocess
import sys
import threading
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp import web
from litestar.testing import AsyncTestClient
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.app import create_app
from gateway.config import Settings
from gateway.tracing import NO_TRACING, OtelTracing, start_tracing
from tests.servers import start

pytestmark = pytest.mark.integration

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
TRACEPARENT = f"00-{CLIENT_TRACE}-b7ad6b7169203331-01"
QUESTIONS = ["Please describe, in a few careful sentences, how a paged KV cache shares prompt prefixes.",
             "Thanks. And what happens when that cache is full and a new request arrives?"]


@pytest.fixture(scope="module")
def sims():
    servers = []
    try:
        sim = ["sim", "--stream-kv-params", "--output-tokens", "80:100"]
        servers.append(start([*sim, "--role", "prefill", "--engine-id", "p0"]))
        servers.append(start([*sim, "--role", "decode", "--engine-id", "d0"]))
        yield servers
    finally:
        for server in servers:
            server.stop()


class RecordingProxy:
    """Forwards everything to `target`, streaming, and remembers each request's path and headers. Runs on its
    own thread and loop: Litestar's test client runs the app's lifespan on another thread, which must reach it."""

    def __init__(self, target: str) -> None:
        self.target, self.seen = target, []
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self.thread.start()
        ready.wait(10)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._start())
        ready.set()
        self.loop.run_forever()

    async def _start(self) -> None:
        self.session = aiohttp.ClientSession()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        self.seen.append((request.path, dict(request.headers)))
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        async with self.session.request(request.method, self.target + request.path_qs, data=await request.read(),
                                        headers=headers) as upstream:
            response = web.StreamResponse(status=upstream.status,
                                          headers={"Content-Type": upstream.headers.get("Content-Type", "")})
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    def close(self) -> None:
        async def stop() -> None:
            await self.runner.cleanup()
            await self.session.close()
        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def proxies(sims):
    made = [RecordingProxy(sims[0].url), RecordingProxy(sims[1].url)]
    yield made
    for proxy in made:
        proxy.close()


async def test_spans_per_turn_and_leg_and_traceparent_forwarded(proxies, caplog):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    caplog.set_level(logging.INFO)
    # reads whenever continuity allows (on untimed sims the cost plan's probe finds recomputing faster)
    settings = Settings(prefill=[proxies[0].url], decode=[proxies[1].url], health_interval_s=60,
                        local_prefill_max_tokens=0,       # a P leg and a D leg per later turn, each a span
                        reuse_policy="always")
    async with AsyncTestClient(create_app(settings, tracing=OtelTracing(provider))) as client:
        started = [len(proxy.seen) for proxy in proxies]     # start-up probes (P's pinned-ids proof) came before
        messages = []
        for i, question in enumerate(QUESTIONS):
            messages.append({"role": "user", "content": question})
            headers = {"X-Session-Id": "traced", **({"traceparent": TRACEPARENT} if i == 0 else {})}
            body = {"model": "demo", "messages": messages, "max_tokens": 100, "stream": i == 1}
            response = await client.post("/v1/chat/completions", json=body, headers=headers)
            assert response.status_code == 200, response.text
            messages.append({"role": "assistant", "content": answer_of(response, stream=i == 1)})
        assert response.headers["x-pd-plan"] == "reuse"

    spans = exporter.get_finished_spans()
    turns = [s for s in spans if s.name == "pd.turn"]
    assert len(turns) == 2
    first, second = turns
    assert first.context.trace_id == int(CLIENT_TRACE, 16)           # the client's trace, continued
    assert second.context.trace_id != first.context.trace_id          # no traceparent: a new trace
    assert (first.attributes["pd.plan"], first.attributes["pd.reason"]) == ("full", "first_turn")
    assert (second.attributes["pd.plan"], second.attributes["pd.reason"]) == ("reuse", "continuous")
    assert second.attributes["pd.reused_tokens"] > 0
    assert second.attributes["pd.reused_tokens"] + second.attributes["pd.computed_tokens"] \
        == second.attributes["pd.prompt_tokens"]
    assert second.attributes["pd.stream"] is True

    for turn in turns:
        legs = [s for s in spans if s.parent is not None and s.parent.span_id == turn.context.span_id]
        assert [leg.name for leg in legs] == ["pd.prefill", "pd.decode"]
        for leg in legs:
            assert leg.attributes["pd.plan"] == turn.attributes["pd.plan"]
            assert leg.attributes["pd.reused_tokens"] == turn.attributes["pd.reused_tokens"]
            assert leg.end_time <= turn.end_time

    # Each engine request carried the traceparent of its own leg span.
    leg_ids = {(s.name, f"00-{s.context.trace_id:032x}-{s.context.span_id:016x}-{s.context.trace_flags:02x}")
               for s in spans if s.name in ("pd.prefill", "pd.decode")}
    turns_p, turns_d = proxies[0].seen[started[0]:], proxies[1].seen[started[1]:]
    sent = {("pd.prefill", h.get("traceparent")) for path, h in turns_p if path == "/v1/chat/completions"}
    sent |= {("pd.decode", h.get("traceparent")) for path, h in turns_d if path == "/v1/chat/completions"}
    assert sent == leg_ids
    assert not [h for path, h in proxies[0].seen + proxies[1].seen if path == "/health" and "traceparent" in h]

    # The start-up report and one info line per turn, with plan and reason.
    assert any("pd-gateway start-up report" in r.getMessage() for r in caplog.records)
    turn_lines = [r.getMessage() for r in caplog.records if r.name == "gateway.turn" and r.levelno == logging.INFO]
    assert [line.split()[2:4] for line in turn_lines if line.startswith("turn ")] == \
        [["plan=full", "reason=first_turn"], ["plan=reuse", "reason=continuous"]]


def answer_of(response, stream: bool) -> str:
    if not stream:
        return response.json()["choices"][0]["message"]["content"]
    chunks = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: {")]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))


def test_tracing_off_is_a_shared_no_op():
    assert start_tracing("off") is NO_TRACING
    turn = NO_TRACING.turn(object())
    assert turn is NO_TRACING.turn(object()) and turn.leg("prefill", "http://p", object()).headers == {}
    assert NO_TRACING.middleware() == []


def test_tracing_off_never_loads_the_sdk_tracer():
    """redis-py imports parts of the OpenTelemetry API itself when installed; the SDK tracer and the W3C
    propagator are only ever loaded by gateway.tracing, and only when tracing is on."""
    code = ("import sys\nfrom gateway.app import create_app\nfrom gateway.config import Settings\n"
            "create_app(Settings(prefill=['http://p:1'], decode=['http://d:1']))\n"
            "print([m for m in ('opentelemetry.sdk.trace', 'opentelemetry.trace.propagation.tracecontext')"
            " if m in sys.modules])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_console_tracing_prints_turn_and_leg_spans(capsys):
    tracing = start_tracing("console")
    req = SimpleNamespace(request_id="r1", endpoint="/v1/chat/completions", model="m", stream=False,
                          prompt_ids=[1, 2, 3])
    plan = SimpleNamespace(kind="full", reason="first_turn", reused_tokens=0)
    turn = tracing.turn(req)
    leg = turn.leg("prefill", "http://p0:8100", plan)
    assert re.fullmatch(r"00-[0-9a-f]{32}-[0-9a-f]{16}-0[0-3]", leg.headers["traceparent"])
    turn.finish(plan, 0, 3)
    tracing.shutdown()
    err = capsys.readouterr().err
    assert '"name": "pd.turn"' in err and '"name": "pd.prefill"' in err and '"pd.computed_tokens": 3' in err


def test_otlp_tracing_builds_its_exporter():
    tracing = start_tracing("otlp", "http://127.0.0.1:9/v1/traces")
    assert tracing.enabled and tracing.middleware()
    tracing.shutdown()                   # nothing was recorded: nothing to send
