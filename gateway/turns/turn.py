"""One turn, top to bottom: plan, P leg, D leg, relay, record. Read this file to know what a request does."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec

from gateway.config import Settings
from gateway.engines import sse
from gateway.engines.client import EngineClient, EngineStream
from gateway.engines.pool import Engine, EnginePool
from gateway.errors import GatewayError
from gateway.store import Conversation, ConversationKey, ConversationStore, StoreUnavailableError, TurnStart
from gateway.telemetry import Metrics
from gateway.turns import plan as plans
from gateway.turns.continuity import Fingerprint
from gateway.turns.legs import DecodeCapture, TurnRequest, decode_body, prefill_body, prompt_ids_of
from gateway.turns.plan import Plan, Reason
from gateway.turns.restream import restream

log = logging.getLogger("gateway.turn")
_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode


@dataclass
class TurnReply:
    headers: dict[str, str]
    body: bytes | None = None                       # non-streaming JSON
    stream: AsyncIterator[bytes] | None = None      # SSE frames


@dataclass
class _Turn:
    """Everything one turn carries from planning to recording."""
    req: TurnRequest
    session: ConversationKey | None
    start: TurnStart | None
    plan: Plan
    prefill: Engine
    decode: Engine
    began: float


class TurnRunner:
    def __init__(self, *, client: EngineClient, prefill: EnginePool, decode: EnginePool,
                 store: ConversationStore, metrics: Metrics, settings: Settings, block_size: int,
                 served_model: str) -> None:
        self.client, self.prefill_pool, self.decode_pool = client, prefill, decode
        self.store, self.metrics, self.settings, self.block_size = store, metrics, settings, block_size
        self.served_model = served_model
        self._background: set[asyncio.Task] = set()

    async def run(self, req: TurnRequest, session: ConversationKey | None) -> TurnReply:
        began = time.perf_counter()
        start, plan = await self._plan(req, session)
        record = start.record if start else None
        turn = _Turn(req, session, start, plan, self.prefill_pool.pick_prefill(),
                     self.decode_pool.pick_decode(record.decode_engine if record else None,
                                                  self.settings.decode_load_bound), began)
        self._observe("plan", began)
        if plan.release:
            self.release(plan.release, plan.reason.value)
        try:
            prefill_handle = await self._prefill_leg(turn)
            body = decode_body(req, prefill_handle)
            if req.stream and self.settings.stream_handle_policy == "miss":
                return await self._stream_decode(turn, body)
            return await self._json_decode(turn, body)
        except BaseException:
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
        held = Fingerprint(record.block_size, record.held_tokens, record.block_hashes, record.prefix_hash)
        return plans.plan_with_handle(req.prompt_ids, held, start.handle)

    # -- legs ----------------------------------------------------------------------------------------
    async def _prefill_leg(self, turn: _Turn) -> dict[str, Any] | None:
        began = time.perf_counter()
        response = await self._call_prefill(turn, turn.plan.prefill_params)
        if turn.plan.handle is not None and prompt_ids_of(response) not in (None, turn.req.prompt_ids):
            # P ran on other tokens than the ones verified: its read of D's KV is garbage. Redo it without.
            log.warning("parity violation on %s: P's prompt differs from the rendered one", turn.req.request_id)
            turn.plan = plans.full(Reason.PARITY_VIOLATION)
            response = await self._call_prefill(turn, turn.plan.prefill_params)
        self._observe("prefill", began)
        return response.get("kv_transfer_params")

    async def _call_prefill(self, turn: _Turn, params: dict[str, Any]) -> dict[str, Any]:
        with turn.prefill.track(len(turn.req.prompt_ids)):
            try:
                return await self.client.post_json(
                    turn.prefill.url, turn.req.endpoint, prefill_body(turn.req, params),
                    timeout_s=self.settings.prefill_timeout_s, headers=self._headers(turn.req))
            except GatewayError as exc:
                self.metrics.upstream_errors.labels("prefill", exc.code).inc()
                raise

    async def _json_decode(self, turn: _Turn, body: dict[str, Any]) -> TurnReply:
        began = time.perf_counter()
        body["stream"] = False
        body.pop("stream_options", None)
        with turn.decode.track():
            try:
                response = await self.client.post_json(
                    turn.decode.url, turn.req.endpoint, body, timeout_s=self.settings.decode_first_byte_timeout_s,
                    headers=self._headers(turn.req))
            except GatewayError as exc:
                self.metrics.upstream_errors.labels("decode", exc.code).inc()
                raise
        self._observe("decode_ttft", began)
        capture = DecodeCapture()
        view = capture.take(response, turn.req.want_token_ids)
        await self._record(turn, capture)
        if turn.req.stream:      # policy "buffer": the client asked for a stream; re-stream the whole answer
            return TurnReply(self._reply_headers(turn), stream=restream(view, turn.req))
        return TurnReply(self._reply_headers(turn), body=_encode(view))

    async def _stream_decode(self, turn: _Turn, body: dict[str, Any]) -> TurnReply:
        turn.decode.outstanding_requests += 1
        try:
            stream = await self.client.open_stream(
                turn.decode.url, turn.req.endpoint, body,
                first_byte_timeout_s=self.settings.decode_first_byte_timeout_s,
                idle_timeout_s=self.settings.decode_idle_timeout_s, headers=self._headers(turn.req))
        except GatewayError as exc:
            turn.decode.outstanding_requests -= 1
            self.metrics.upstream_errors.labels("decode", exc.code).inc()
            raise
        return TurnReply(self._reply_headers(turn), stream=self._relay(turn, stream))

    async def _relay(self, turn: _Turn, stream: EngineStream) -> AsyncIterator[bytes]:
        """Pass D's SSE events through as they come, minus engine internals; record before `[DONE]`."""
        capture, began, first = DecodeCapture(), time.perf_counter(), True
        recorded = False
        try:
            while (event := await stream.next_event()) is not None:
                if first:
                    self._observe("decode_ttft", began)
                    first = False
                if event == sse.DONE:
                    break
                yield sse.frame(_encode(capture.take(_decode(event), turn.req.want_token_ids)))
            if not capture.handle and capture.finished:
                self.metrics.handles_missing.labels(Reason.HANDLE_NOT_STREAMED.value).inc()
            await self._record(turn, capture)
            recorded = True
            yield sse.frame(sse.DONE)
        except GatewayError as exc:
            self.metrics.upstream_errors.labels("decode", exc.code).inc()
            yield sse.frame(_encode(exc.body()))
            yield sse.frame(sse.DONE)
        finally:
            stream.close()           # on client disconnect too: closing the connection aborts the request on D
            turn.decode.outstanding_requests -= 1
            if not recorded:
                await _shielded(self._abandon(turn))

    # -- outcome -------------------------------------------------------------------------------------
    async def _record(self, turn: _Turn, capture: DecodeCapture) -> None:
        self.metrics.turns.labels(turn.plan.kind.value, turn.plan.reason.value).inc()
        reused = min(turn.plan.reused_tokens, len(turn.req.prompt_ids))
        self.metrics.prompt_tokens.labels("reused").inc(reused)
        self.metrics.prompt_tokens.labels("computed").inc(len(turn.req.prompt_ids) - reused)
        self._observe("total", turn.began)
        handle = self._verified_handle(capture)
        if turn.session is None or turn.start is None or not capture.finished:
            if handle:
                self.release(handle, "unused")
            return
        now = time.time()
        tokens = (capture.prompt_ids or []) + capture.output_ids
        held = handle["remote_num_tokens"] if handle else 0
        fingerprint = Fingerprint.of(tokens, held, self.block_size)
        previous = turn.start.record
        record = Conversation(
            decode_engine=turn.decode.url, prefill_engine=turn.prefill.url, model=turn.req.model,
            block_size=self.block_size, num_tokens=len(tokens), held_tokens=fingerprint.held_tokens,
            block_hashes=fingerprint.block_hashes, prefix_hash=fingerprint.prefix_hash,
            handle_note="" if handle else _missing_note(turn.req, capture),
            created_at=previous.created_at if previous else now, updated_at=now)
        try:
            stored = await self._timed_store("finish_turn", self.store.finish_turn(
                turn.session, turn.start.turn, record, handle, now + self.settings.handle_ttl_s, now))
        except StoreUnavailableError:
            stored = False
        if handle and not stored:
            self.release(handle, "superseded")

    def _verified_handle(self, capture: DecodeCapture) -> dict[str, Any] | None:
        """Keep D's handle only if D told us exactly which tokens it holds (prompt + output - 1)."""
        handle = capture.handle
        if not handle or capture.prompt_ids is None or not capture.output_ids_seen:
            return None
        if handle.get("remote_num_tokens") != len(capture.prompt_ids) + len(capture.output_ids) - 1:
            log.warning("D handle covers %s tokens, expected prompt+output-1: not stored",
                        handle.get("remote_num_tokens"))
            self.release(handle, "unverifiable")
            return None
        return handle

    async def _abandon(self, turn: _Turn) -> None:
        """A failed turn stores nothing new, but marks itself finished so later turns are not 'concurrent'."""
        if turn.session is None or turn.start is None:
            return
        self.metrics.turns.labels(turn.plan.kind.value, turn.plan.reason.value).inc()
        record = turn.start.record or Conversation(model=turn.req.model, block_size=self.block_size)
        try:
            await self.store.finish_turn(turn.session, turn.start.turn, record, None, 0.0, time.time())
        except StoreUnavailableError:
            pass

    def release(self, handle: dict[str, Any], why: str) -> None:
        """Free D's pinned blocks now rather than at their TTL: a zero-token read through any P."""
        self.metrics.handles_released.labels(why).inc()
        task = asyncio.get_running_loop().create_task(self._release(handle))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release(self, handle: dict[str, Any]) -> None:
        try:
            engine = self.prefill_pool.pick_prefill()
            body = {"model": self.served_model, "prompt": [0], "max_tokens": 1, "stream": False,
                    "kv_transfer_params": plans.release_params(handle)}
            await self.client.post_json(engine.url, "/v1/completions", body,
                                        timeout_s=self.settings.prefill_timeout_s)
        except GatewayError as exc:
            log.info("could not release a D handle (%s); D frees it at its TTL", exc.code)

    async def drain(self) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    # -- small things --------------------------------------------------------------------------------
    def _headers(self, req: TurnRequest) -> dict[str, str]:
        return {"X-Request-Id": req.request_id}

    def _reply_headers(self, turn: _Turn) -> dict[str, str]:
        headers = {"X-Request-Id": turn.req.request_id}
        if self.settings.pd_headers:
            headers.update({"X-PD-Plan": turn.plan.kind.value, "X-PD-Reason": turn.plan.reason.value,
                            "X-PD-Reused-Tokens": str(min(turn.plan.reused_tokens, len(turn.req.prompt_ids)))})
        return headers

    def _observe(self, phase: str, began: float) -> None:
        self.metrics.turn_seconds.labels(phase).observe(time.perf_counter() - began)

    async def _timed_store(self, op: str, call):
        began = time.perf_counter()
        try:
            return await call
        except StoreUnavailableError:
            self.metrics.store_errors.labels(op).inc()
            raise
        finally:
            self.metrics.store_seconds.labels(op).observe(time.perf_counter() - began)


_NO_HANDLE_REASONS = {"expired": Reason.HANDLE_EXPIRED, "in_flight": Reason.CONCURRENT_TURN}


def _missing_reason(record: Conversation) -> Reason:
    return Reason(record.handle_note) if record.handle_note else Reason.NO_HANDLE


def _missing_note(req: TurnRequest, capture: DecodeCapture) -> str:
    return Reason.HANDLE_NOT_STREAMED.value if req.stream and capture.finished else ""


async def _shielded(coro) -> None:
    try:
        await asyncio.shield(coro)
    except (asyncio.CancelledError, Exception):  # a dying stream must not raise from its cleanup
        pass
