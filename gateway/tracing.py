"""OpenTelemetry tracing: a span per turn, a span per leg (P, D), W3C trace context forwarded to the engines.

Off unless configured (`--tracing console|otlp`, `--otlp-endpoint URL`). Off costs nothing: `NO_TRACING` hands
out shared no-op objects and opentelemetry is never imported. On, a turn's span continues the client's
`traceparent` when it sent one, and each leg's request carries the leg span's `traceparent`, so a vLLM started
with `--otlp-traces-endpoint` joins the same trace.

    turn = tracing.turn(req)                                   # span "pd.turn"
    leg = turn.leg("prefill", url, plan)                       # span "pd.prefill", child of the turn
    post(..., headers={"X-Request-Id": ..., **leg.headers})    # carries the leg span's traceparent
    turn.leg_failed(error)                                     # if that engine failed (then maybe a retry)
    turn.leg("decode", url, plan)                              # ends the prefill leg, opens the decode leg
    turn.finish(plan, reused, computed)                        # ends the turn and the leg still open

Legs of a turn run one after the other, so a leg ends when the next begins or the turn ends: a streamed
D leg's span covers the whole stream.

Imports no gateway module (a leaf, like telemetry): plans and requests are read by attribute.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Protocol

SERVICE_NAME = "pd-gateway"


class PlanLike(Protocol):
    kind: Any             # StrEnum: reuse | partial | full
    reason: Any           # StrEnum: a reason code
    reused_tokens: int


class TurnRequestLike(Protocol):
    request_id: str
    endpoint: str
    model: str
    stream: bool
    prompt_ids: list[int]


# -- the no-op path: what every turn gets while tracing is off ---------------------------------------
class LegTrace:
    headers: dict[str, str] = {}          # never mutated: callers copy it into their own headers

    def end(self, error: BaseException | None = None) -> None:
        pass


class TurnTrace:
    def leg(self, name: str, engine: str, plan: PlanLike) -> LegTrace:
        return NO_LEG

    def leg_failed(self, error: BaseException) -> None:
        pass

    def finish(self, plan: PlanLike, reused: int, computed: int) -> None:
        pass

    def fail(self, plan: PlanLike, error: BaseException | None = None) -> None:
        pass


class Tracing:
    enabled = False

    def turn(self, req: TurnRequestLike) -> TurnTrace:
        return NO_TURN

    def middleware(self) -> list[Any]:
        return []

    def shutdown(self) -> None:
        pass


NO_LEG, NO_TURN, NO_TRACING = LegTrace(), TurnTrace(), Tracing()


def start_tracing(mode: str, endpoint: str | None = None) -> Tracing:
    """`off` → NO_TRACING; `console` → spans on stderr; `otlp` → OTLP/HTTP to `endpoint` (or OTEL_* env)."""
    if mode == "off":
        return NO_TRACING
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor
    except ImportError:
        raise ValueError(f"--tracing {mode} needs OpenTelemetry: pip install 'pd-gateway[tracing]'") from None
    name = os.environ.get("OTEL_SERVICE_NAME", SERVICE_NAME)
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    if mode == "console":
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(out=sys.stderr)))
    else:
        provider.add_span_processor(BatchSpanProcessor(_otlp_exporter(endpoint)))
    return OtelTracing(provider)


def _otlp_exporter(endpoint: str | None) -> Any:
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        raise ValueError("--tracing otlp needs the OTLP exporter: pip install 'pd-gateway[tracing]'") from None
    return OTLPSpanExporter(endpoint=endpoint) if endpoint else OTLPSpanExporter()


# -- the OpenTelemetry path --------------------------------------------------------------------------
class OtelTracing(Tracing):
    """Spans from one TracerProvider (the app's own, like its metrics registry, so tests can build several)."""
    enabled = True

    def __init__(self, provider: Any) -> None:
        from opentelemetry import context, trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self.tracer = provider.get_tracer("gateway.turn")
        self.propagator = TraceContextTextMapPropagator()
        self.otel_trace, self.otel_context = trace, context

    def turn(self, req: TurnRequestLike) -> TurnTrace:
        span = self.tracer.start_span("pd.turn", kind=self.otel_trace.SpanKind.SERVER, attributes={
            "pd.request_id": req.request_id, "pd.endpoint": req.endpoint, "gen_ai.request.model": req.model,
            "pd.stream": req.stream, "pd.prompt_tokens": len(req.prompt_ids)})
        return _OtelTurn(self, span, len(req.prompt_ids))

    def middleware(self) -> list[Any]:
        return [self._continue_client_trace]

    def _continue_client_trace(self, app: Any) -> Any:
        """ASGI middleware: a request's `traceparent` becomes the current context, so its turn span joins it."""
        async def middleware(scope: dict[str, Any], receive: Any, send: Any) -> None:
            carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers") or ()
                       if k in (b"traceparent", b"tracestate")} if scope["type"] == "http" else {}
            if not carrier:
                await app(scope, receive, send)
                return
            token = self.otel_context.attach(self.propagator.extract(carrier))
            try:
                await app(scope, receive, send)
            finally:
                self.otel_context.detach(token)
        return middleware

    def shutdown(self) -> None:
        self.provider.shutdown()       # flushes what the batch processor still holds


class _OtelLeg(LegTrace):
    def __init__(self, tracing: OtelTracing, span: Any) -> None:
        self.span, self._trace, self._ended = span, tracing.otel_trace, False
        self.headers = {}
        tracing.propagator.inject(self.headers, context=self._trace.set_span_in_context(span))

    def end(self, error: BaseException | None = None) -> None:
        if self._ended:
            return
        self._ended = True
        _mark_error(self._trace, self.span, error)
        self.span.end()


class _OtelTurn(TurnTrace):
    def __init__(self, tracing: OtelTracing, span: Any, prompt_tokens: int) -> None:
        self.tracing, self.span, self.prompt_tokens = tracing, span, prompt_tokens
        self.legs: list[_OtelLeg] = []
        self._ended = False

    def leg(self, name: str, engine: str, plan: PlanLike) -> LegTrace:
        if self.legs:
            self.legs[-1].end()
        trace = self.tracing.otel_trace
        span = self.tracing.tracer.start_span(
            f"pd.{name}", context=trace.set_span_in_context(self.span), kind=trace.SpanKind.CLIENT,
            attributes={"pd.leg": name, "server.address": engine, **self._plan_attributes(plan)})
        self.legs.append(_OtelLeg(self.tracing, span))
        return self.legs[-1]

    def leg_failed(self, error: BaseException) -> None:
        if self.legs:
            self.legs[-1].end(error)

    def finish(self, plan: PlanLike, reused: int, computed: int) -> None:
        self._end(plan, None, {"pd.reused_tokens": reused, "pd.computed_tokens": computed})

    def fail(self, plan: PlanLike, error: BaseException | None = None) -> None:
        self._end(plan, error or sys.exc_info()[1] or RuntimeError("turn failed"), {})

    def _end(self, plan: PlanLike, error: BaseException | None, tokens: dict[str, int]) -> None:
        if self._ended:
            return
        self._ended = True
        if self.legs:
            self.legs[-1].end(error)
        self.span.set_attributes({**self._plan_attributes(plan), **tokens})
        _mark_error(self.tracing.otel_trace, self.span, error)
        self.span.end()

    def _plan_attributes(self, plan: PlanLike) -> dict[str, Any]:
        reused = min(plan.reused_tokens, self.prompt_tokens)
        return {"pd.plan": str(plan.kind), "pd.reason": str(plan.reason), "pd.reused_tokens": reused,
                "pd.computed_tokens": self.prompt_tokens - reused}


def _mark_error(trace: Any, span: Any, error: BaseException | None) -> None:
    if error is not None:
        span.record_exception(error)
        span.set_status(trace.Status(trace.StatusCode.ERROR, type(error).__name__))
