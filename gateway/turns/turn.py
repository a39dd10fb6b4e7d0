"""One turn, top to bottom: admit, plan, P leg, D leg, relay, record. Read this file to know what a request does.

Retries only where safe: an engine that refused the connection never saw the request, so the same leg goes
to another engine unchanged; any other failure may have consumed a handle, so P is redone without one.
Nothing is retried once the client has received a byte.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec

from gateway.config import Settings
from gateway.engines import sse
from gateway.engines.client import EngineClient, EngineStream
from gateway.engines.pool import Engine, EnginePool
from gateway.errors import (
    EngineConnectError,
    EngineTimeoutError,
    EngineUnavailableError,
    GatewayError,
    UpstreamError,
)
from gateway.store import Answer, Conversation, ConversationKey, ConversationStore, StoreUnavailableError, TurnStart
from gateway.telemetry import Metrics, log_turn
from gateway.tracing import NO_TRACING, NO_TURN, Tracing, TurnTrace
from gateway.turns import plan as plans
from gateway.turns.admission import Admission, Ticket
from gateway.turns.continuity import Fingerprint, held_fingerprint
from gateway.turns.generated import remember
from gateway.turns.legs import DecodeCapture, TurnRequest, decode_body, prefill_body, prompt_ids_of
from gateway.turns.plan import Plan, Reason
from gateway.turns.release import HandleReleaser
from gateway.turns.render import Renderer
from gateway.turns.restream import restream

log = logging.getLogger("gateway.turn")
_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode
T = TypeVar("T")


@dataclass
class TurnReply:
    headers: dict[str, str]
    body: bytes | None = None                       # non-streaming JSON
    stream: AsyncGenerator[bytes, None] | None = None   # SSE frames


@dataclass
class _Turn:
    """Everything one turn carries from planning to recording."""
    req: TurnRequest
    session: ConversationKey | None
    ticket: Ticket
    began: float
    start: TurnStart | None = None
    plan: Plan = field(default_factory=lambda: plans.full(Reason.NO_SESSION))
    prefill: Engine | None = None
    decode: Engine | None = None
    prefill_handle: dict[str, Any] | None = None
    retries_left: int = 0
    failed: set[str] = field(default_factory=set)     # engines that failed this turn: not picked again
    last_error: GatewayError | None = None
    trace: TurnTrace = NO_TURN                         # its spans, when tracing is on

    def retry_after(self, error: GatewayError, engine: Engine | None) -> None:
        """Spend one retry on `engine`'s failure (None: the engine is fine, the request was not), or give up."""
        self.trace.leg_failed(error)
        if engine is not None:
            self.failed.add(engine.url)
        self.last_error = error
        if self.retries_left <= 0:
            raise error
        self.retries_left -= 1

    def pick(self, pick: Callable[[frozenset[str]], Engine]) -> Engine:
        """An engine that has not failed this turn; none left: the last engine error, not a bare 503."""
        try:
            return pick(frozenset(self.failed))
        except EngineUnavailableError:
            if self.last_error is not None:
                raise self.last_error from None
            raise


class TurnRunner:
    def __init__(self, *, client: EngineClient, prefill: EnginePool, decode: EnginePool,
                 store: ConversationStore, metrics: Metrics, settings: Settings, block_size: int,
                 served_model: str, tracing: Tracing = NO_TRACING, renderer: Renderer | None = None) -> None:
        self.client, self.prefill_pool, self.decode_pool = client, prefill, decode
        self.store, self.metrics, self.settings, self.block_size = store, metrics, settings, block_size
        self.admission = Admission(settings.max_concurrent_turns, settings.max_queued_prompt_tokens)
        self.releaser = HandleReleaser(client, prefill, metrics, served_model)
        self.tracing = tracing
        self.renderer = renderer            # history_tokens "generated": to keep D's answers as it made them

    async def run(self, req: TurnRequest, session: ConversationKey | None) -> TurnReply:
        turn = _Turn(req, session, self.admission.admit(len(req.prompt_ids)), time.perf_counter(),
                     retries_left=self.settings.max_retries)
        turn.trace = self.tracing.turn(req)
        try:
            turn.start, turn.plan = await self._plan(req, session)
            self._observe("plan", turn.began)
            if turn.plan.release:
                self.releaser.release(turn.plan.release, turn.plan.reason.value)
            await self._prefill_leg(turn)
            return await self._decode_leg(turn)
        except BaseException:
            turn.ticket.close()
            await self._abandon(turn)
            raise

    # -- planning ------------------------------------------------------------------------------------
    async def _plan(self, req: TurnRequest, session: ConversationKey | None) -> tuple[TurnStart | None, Plan]:
        if session is None:
            return None, plans.full(Reason.NO_SESSION)
        try:
            start = await self._timed_store("begin_turn", self.store.begin_turn(session, time.time()))
        except StoreUnavailableError:
            return None, plans.full(Reason.STORE_UNAVAILABLE)
        if req.rerender is not None and start.record is not None and start.record.answers:
            req.prompt_ids = req.rerender(start.record.answers)      # past answers as D generated them
        return start, self._plan_from(req, start)

    def _plan_from(self, req: TurnRequest, start: TurnStart) -> Plan:
        record = start.record
        if record is None:
            return plans.full(Reason.FIRST_TURN)
        if start.handle_state != "claimed" or start.handle is None:
            return plans.full(_NO_HANDLE_REASONS.get(start.handle_state) or _missing_reason(record))
        holder = self.decode_pool.get(record.decode_engine)
        if holder is None or not holder.healthy:
            return plans.full(Reason.DECODE_UNAVAILABLE)     # nobody left to read from or to release
        if record.model != req.model:
            return plans.full(Reason.MODEL_CHANGED, release=start.handle)
        return plans.plan_with_handle(req.prompt_ids, _fingerprint(record), start.handle)

    # -- P leg ---------------------------------------------------------------------------------------
    async def _prefill_leg(self, turn: _Turn) -> None:
        began = time.perf_counter()
        response = await self._call_prefill(turn)
        if turn.plan.handle is not None and prompt_ids_of(response) not in (None, turn.req.prompt_ids):
            # P ran on other tokens than the ones verified: its read of D's KV is garbage. Redo it without.
            log.warning("parity violation on %s: P's prompt differs from the rendered one", turn.req.request_id)
            turn.plan = plans.full(Reason.PARITY_VIOLATION)
            response = await self._call_prefill(turn)
        turn.prefill_handle = response.get("kv_transfer_params")
        turn.ticket.prefilled()
        self._observe("prefill", began)

    async def _call_prefill(self, turn: _Turn) -> dict[str, Any]:
        while True:
            turn.prefill = turn.pick(lambda failed: self.prefill_pool.pick_prefill(
                self._prefill_affinity(turn), self.settings.prefill_affinity_slack_tokens, exclude=failed))
            with_handle = turn.plan.handle is not None
            body = prefill_body(turn.req, turn.plan.prefill_params, confirm_ids=with_handle)
            # vLLM can park a P request whose read of D's blocks it declined (docs/vllm-findings.md #8): a leg
            # that carries a handle gets a short deadline, then P is redone without it, on any P.
            timeout = self.settings.prefill_handle_timeout_s if with_handle else self.settings.prefill_timeout_s
            try:
                return await self._leg(turn.prefill, self.client.post_json(
                    turn.prefill.url, turn.req.endpoint, body, timeout_s=timeout,
                    headers=self._headers(turn, "prefill"), decode=turn.req.decode_answer), len(turn.req.prompt_ids))
            except EngineConnectError as exc:
                turn.retry_after(exc, turn.prefill)      # P never saw it: the same plan, another P
            except EngineTimeoutError as exc:
                turn.retry_after(exc, None if with_handle else turn.prefill)
                turn.plan = plans.full(Reason.PREFILL_FAILED) if with_handle else turn.plan
            except UpstreamError as exc:
                turn.retry_after(exc, turn.prefill)      # P may have consumed D's handle: no handle now
                if turn.plan.handle is not None:
                    turn.plan = plans.full(Reason.PREFILL_FAILED)

    def _prefill_affinity(self, turn: _Turn) -> str | None:
        record = turn.start.record if turn.start else None
        return record.prefill_engine if record and self.settings.prefill_affinity else None

    # -- D leg ---------------------------------------------------------------------------------------
    async def _decode_leg(self, turn: _Turn) -> TurnReply:
        record = turn.start.record if turn.start else None
        while True:
            turn.decode = turn.pick(lambda failed: self.decode_pool.pick_decode(
                record.decode_engine if record else None, self.settings.decode_load_bound, exclude=failed))
            try:
                if turn.req.stream and self.settings.stream_handle_policy == "miss":
                    return await self._stream_decode(turn)
                return await self._json_decode(turn)
            except EngineConnectError as exc:
                turn.retry_after(exc, turn.decode)       # D never saw P's handle: it is still good
            except UpstreamError as exc:
                turn.retry_after(exc, turn.decode)       # D may have read P's blocks: prefill afresh
                turn.plan = plans.full(Reason.DECODE_FAILED)
                await self._prefill_leg(turn)

    async def _json_decode(self, turn: _Turn) -> TurnReply:
        began = time.perf_counter()
        body = decode_body(turn.req, turn.prefill_handle)
        body["stream"] = False
        body.pop("stream_options", None)
        response = await self._leg(turn.decode, self.client.post_json(
            turn.decode.url, turn.req.endpoint, body, timeout_s=self.settings.decode_first_byte_timeout_s,
            headers=self._headers(turn, "decode")))
        self._observe("decode_ttft", began)
        capture = DecodeCapture()
        view = capture.take(response, turn.req.want_token_ids)
        try:
            await self._record(turn, capture)
        finally:
            turn.ticket.close()
        if turn.req.stream:      # policy "buffer": the client asked for a stream; re-stream the whole answer
            return TurnReply(self._reply_headers(turn), stream=restream(view, turn.req))
        return TurnReply(self._reply_headers(turn), body=_encode(view))

    async def _stream_decode(self, turn: _Turn) -> TurnReply:
        body = decode_body(turn.req, turn.prefill_handle)
        stream = await self._leg(turn.decode, self.client.open_stream(
            turn.decode.url, turn.req.endpoint, body,
            first_byte_timeout_s=self.settings.decode_first_byte_timeout_s,
            idle_timeout_s=self.settings.decode_idle_timeout_s, headers=self._headers(turn, "decode")))
        return TurnReply(self._reply_headers(turn), stream=self._relay(turn, stream))

    async def _relay(self, turn: _Turn, stream: EngineStream) -> AsyncGenerator[bytes, None]:
        """Pass D's SSE events through as they come, minus engine internals; record before `[DONE]`."""
        capture, began, first, recorded = DecodeCapture(), time.perf_counter(), True, False
        turn.decode.outstanding_requests += 1
        try:
            done = False
            while not done and (events := await stream.next_events()) is not None:
                if first:
                    self._observe("decode_ttft", began)
                    first = False
                frames = []                  # the events of one read go out in one write
                for event in events:
                    if event == sse.DONE:
                        done = True
                        break
                    frames.append(sse.frame(_encode(capture.take(turn.req.decode_answer(event),
                                                                 turn.req.want_token_ids))))
                if frames:
                    yield b"".join(frames)
            if not capture.handle and capture.finished:
                self.metrics.handles_missing.labels(Reason.HANDLE_NOT_STREAMED.value).inc()
            await self._record(turn, capture)
            recorded = True
            yield sse.frame(sse.DONE)
        except GatewayError as exc:
            # After the first byte nothing is retried: an OpenAI-shaped error event, then [DONE].
            self.metrics.upstream_errors.labels("decode", exc.code).inc()
            turn.decode.failed()
            yield sse.frame(_encode(exc.body()))
            yield sse.frame(sse.DONE)
        finally:
            stream.close()           # on client disconnect too: closing the connection aborts the request on D
            turn.decode.outstanding_requests -= 1
            turn.ticket.close()
            if not recorded:
                await _shielded(self._abandon(turn))

    # -- outcome -------------------------------------------------------------------------------------
    async def _record(self, turn: _Turn, capture: DecodeCapture) -> None:
        self._count(turn)
        handle = self._verified_handle(capture)
        if turn.session is None or turn.start is None or not capture.finished:
            if handle:
                self.releaser.release(handle, "unused")
            return
        now = time.time()
        previous = turn.start.record
        num_tokens, fingerprint = held_fingerprint(      # hashes only the blocks the plan did not verify
            turn.req.prompt_ids, capture.prompt_ids, capture.output_ids, handle["remote_num_tokens"] if handle else 0,
            self.block_size, previous=_fingerprint(previous), verified_tokens=turn.plan.reused_tokens)
        record = Conversation(
            decode_engine=turn.decode.url, prefill_engine=turn.prefill.url, model=turn.req.model,
            block_size=self.block_size, num_tokens=num_tokens, held_tokens=fingerprint.held_tokens,
            block_hashes=fingerprint.block_hashes, prefix_hash=fingerprint.prefix_hash,
            handle_note="" if handle else _missing_note(turn.req, capture),
            answers=self._answers(turn, capture), created_at=previous.created_at if previous else now, updated_at=now)
        try:
            stored = await self._timed_store("finish_turn", self.store.finish_turn(
                turn.session, turn.start.turn, record, handle, now + self.settings.handle_ttl_s, now))
        except StoreUnavailableError:
            stored = False
        if handle and not stored:
            self.releaser.release(handle, "superseded")

    def _answers(self, turn: _Turn, capture: DecodeCapture) -> list[Answer]:
        previous = turn.start.record.answers if turn.start and turn.start.record else []
        if turn.req.rerender is None or self.renderer is None:
            return []
        new = self.renderer.answer(capture.output_ids, "".join(capture.text), capture.tool_calls)
        return remember(previous, new) if new else previous

    def _count(self, turn: _Turn) -> None:
        plan, prompt = turn.plan, len(turn.req.prompt_ids)
        self.metrics.turns.labels(plan.kind.value, plan.reason.value).inc()
        reused = min(plan.reused_tokens, prompt)
        self.metrics.prompt_tokens.labels("reused").inc(reused)
        self.metrics.prompt_tokens.labels("computed").inc(prompt - reused)
        self._observe("total", turn.began)
        turn.trace.finish(plan, reused, prompt - reused)
        log_turn(log, request_id=turn.req.request_id, plan=plan.kind.value, reason=plan.reason.value,
                 reused=reused, computed=prompt - reused, seconds=round(time.perf_counter() - turn.began, 4))

    def _verified_handle(self, capture: DecodeCapture) -> dict[str, Any] | None:
        """Keep D's handle only if D told us exactly which tokens it holds (prompt + output - 1)."""
        handle = capture.handle
        if not handle or capture.prompt_ids is None or not capture.output_ids_seen:
            return None
        if handle.get("remote_num_tokens") != len(capture.prompt_ids) + len(capture.output_ids) - 1:
            log.warning("D handle covers %s tokens, expected prompt+output-1: not stored",
                        handle.get("remote_num_tokens"))
            self.releaser.release(handle, "unverifiable")
            return None
        return handle

    async def _abandon(self, turn: _Turn) -> None:
        """A failed turn stores nothing new, but marks itself finished so later turns are not 'concurrent'."""
        turn.trace.fail(turn.plan)
        log_turn(log, request_id=turn.req.request_id, plan=turn.plan.kind.value, reason=turn.plan.reason.value,
                 outcome="failed")
        if turn.session is None or turn.start is None:
            return
        self.metrics.turns.labels(turn.plan.kind.value, turn.plan.reason.value).inc()
        note = Reason.PREVIOUS_TURN_FAILED.value
        record = msgspec.structs.replace(turn.start.record, handle_note=note) if turn.start.record else \
            Conversation(model=turn.req.model, block_size=self.block_size, handle_note=note)
        try:
            await self.store.finish_turn(turn.session, turn.start.turn, record, None, 0.0, time.time())
        except StoreUnavailableError:
            pass

    def release(self, handle: dict[str, Any], why: str) -> None:
        self.releaser.release(handle, why)

    async def drain(self) -> None:
        await self.releaser.drain()

    # -- small things --------------------------------------------------------------------------------
    async def _leg(self, engine: Engine, call: Awaitable[T], prompt_tokens: int = 0) -> T:
        """One engine call: counted as load while it runs, fed to the engine's circuit breaker after."""
        with engine.track(prompt_tokens):
            try:
                result = await call
            except UpstreamError as exc:
                engine.failed()
                self.metrics.upstream_errors.labels(engine.role, exc.code).inc()
                raise
        engine.succeeded()
        return result

    def _headers(self, turn: _Turn, leg: str) -> dict[str, str]:
        """X-Request-Id for correlation; opens the leg's span, whose traceparent goes along when tracing is on."""
        engine = turn.prefill if leg == "prefill" else turn.decode
        return {"X-Request-Id": turn.req.request_id, **turn.trace.leg(leg, engine.url, turn.plan).headers}

    def _reply_headers(self, turn: _Turn) -> dict[str, str]:
        headers = {"X-Request-Id": turn.req.request_id}
        if self.settings.pd_headers:
            headers.update({"X-PD-Plan": turn.plan.kind.value, "X-PD-Reason": turn.plan.reason.value,
                            "X-PD-Reused-Tokens": str(min(turn.plan.reused_tokens, len(turn.req.prompt_ids)))})
        return headers

    def _observe(self, phase: str, began: float) -> None:
        self.metrics.turn_seconds.labels(phase).observe(time.perf_counter() - began)

    async def _timed_store(self, op: str, call: Awaitable[T]) -> T:
        began = time.perf_counter()
        try:
            return await call
        except StoreUnavailableError:
            self.metrics.store_errors.labels(op).inc()
            raise
        finally:
            self.metrics.store_seconds.labels(op).observe(time.perf_counter() - began)


def _fingerprint(record: Conversation | None) -> Fingerprint | None:
    """D's held tokens of the conversation's last turn, as the store keeps them."""
    if record is None:
        return None
    return Fingerprint(record.block_size, record.held_tokens, record.block_hashes, record.prefix_hash)


_NO_HANDLE_REASONS = {"expired": Reason.HANDLE_EXPIRED, "in_flight": Reason.CONCURRENT_TURN}


def _missing_reason(record: Conversation) -> Reason:
    return Reason(record.handle_note) if record.handle_note else Reason.NO_HANDLE


def _missing_note(req: TurnRequest, capture: DecodeCapture) -> str:
    return Reason.HANDLE_NOT_STREAMED.value if req.stream and capture.finished else ""


async def _shielded(coro: Awaitable[None]) -> None:
    try:
        await asyncio.shield(coro)
    except (asyncio.CancelledError, Exception):  # a dying stream must not raise from its cleanup
        pass
