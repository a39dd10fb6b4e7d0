"""The D leg: D answers (JSON, or streamed through chunk by chunk), and what D says of its tokens and its new
handle is captured on the way to the client and recorded before `[DONE]`. Nothing is retried once the client
has received a byte."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Awaitable, Iterator
from typing import Any

import msgspec

from gateway.config import Settings
from gateway.engines import sse
from gateway.engines.client import EngineClient, EngineStream
from gateway.engines.engine import Engine
from gateway.errors import GatewayError
from gateway.telemetry import Metrics
from gateway.turns.legs.calls import EngineCalls
from gateway.turns.legs import chunks
from gateway.turns.legs.capture import DecodeCapture
from gateway.turns.legs.restream import restream
from gateway.turns.intake.request import TurnRequest
from gateway.turns.run.admission import Handovers
from gateway.turns.run.outcome import TurnOutcome
from gateway.turns.reuse.plan import Reason
from gateway.turns.reuse.rates import DecodeTiming, Rates
from gateway.turns.run.turn import Turn, TurnReply

_encode = msgspec.json.Encoder().encode


class DecodeLeg:
    def __init__(self, client: EngineClient, calls: EngineCalls, outcome: TurnOutcome, rates: Rates,
                 metrics: Metrics, settings: Settings) -> None:
        self.client, self.calls, self.outcome, self.rates = client, calls, outcome, rates
        self.metrics, self.settings = metrics, settings
        self.handovers = Handovers(settings.decode_handover_limit)

    async def run(self, turn: Turn, body: dict[str, Any]) -> TurnReply:
        """D's leg with the body the transfer protocol built (`TransferProtocol.decode_body`)."""
        if self.streams(turn):
            return await self._stream(turn, body)
        return await self._json(turn, body)

    def streams(self, turn: Turn) -> bool:
        """D's answer is relayed as it comes (else a JSON leg, re-streamed if the client asked for a stream)."""
        return turn.req.stream and self.settings.stream_handle_policy == "miss"

    async def _json(self, turn: Turn, body: dict[str, Any]) -> TurnReply:
        began = time.perf_counter()
        body["stream"] = False
        body.pop("stream_options", None)
        clock = turn.req.clock
        await self._handover(turn)
        try:
            with turn.decode.running(len(turn.req.prompt_ids)), _decoding(turn.decode):
                response = await self.calls.leg("decode", turn.decode, self.client.post_json(
                    turn.decode.url, turn.req.endpoint, body, timeout_s=self._first_byte_s(turn),
                    headers=turn.leg_headers("decode"), on_sent=clock.decode_out, on_answer=clock.decode_in))
        finally:
            _prefilled(turn)
        self.outcome.release_held_back(turn)
        self.outcome.observe("decode_ttft", began)
        capture = DecodeCapture(cached_tokens=turn.cached_tokens)
        view = capture.take(response, turn.req.want_token_ids)
        try:
            await self.outcome.record(turn, capture)
        finally:
            turn.ticket.close()
        headers = turn.reply_headers(self.settings.pd_headers)
        if turn.req.stream:      # policy "buffer": the client asked for a stream; re-stream the whole answer
            return TurnReply(headers, stream=restream(view, turn.req), cached_tokens=turn.cached_tokens,
                             session=turn.session)
        return TurnReply(headers, body=_encode(view), cached_tokens=turn.cached_tokens, session=turn.session)

    async def _stream(self, turn: Turn, body: dict[str, Any]) -> TurnReply:
        stream, sent = await self.open_stream(turn, body)
        return self.relayed(turn, stream, sent)

    async def open_stream(self, turn: Turn, body: dict[str, Any]) -> tuple[EngineStream, float]:
        """D's streamed leg, up to its response headers (and when it was sent)."""
        await self._handover(turn)
        sent = time.perf_counter()
        if turn.plan.local:              # D's headroom counts it until its first token (reuse/headroom.py)
            turn.local_ahead = turn.decode.local_prefill_tokens
            turn.local_prefill = (turn.decode, len(turn.req.prompt_ids) - turn.reused_tokens)
            turn.decode.local_prefill_tokens += turn.local_prefill[1]
            turn.decode.local_prefills += 1
        try:
            stream = await self.calls.leg("decode", turn.decode, self.client.open_stream(
                turn.decode.url, turn.req.endpoint, body,
                first_byte_timeout_s=self._first_byte_s(turn),
                idle_timeout_s=self.settings.decode_idle_timeout_s, headers=turn.leg_headers("decode"),
                on_sent=turn.req.clock.decode_out))
        except BaseException:
            _prefilled(turn)
            raise
        return stream, sent

    def relayed(self, turn: Turn, stream: EngineStream, sent: float) -> TurnReply:
        return TurnReply(turn.reply_headers(self.settings.pd_headers), stream=self._relay(turn, stream, sent),
                         cached_tokens=turn.cached_tokens, session=turn.session)

    async def _handover(self, turn: Turn) -> None:
        """A P-path D leg waits for its place among its D's hand-overs (pull mode only: a push pair's D leg must
        register before P writes)."""
        if not turn.plan.local and turn.pair is None:
            turn.handover = await self.handovers.enter(turn.decode.url, self._first_byte_s(turn))

    def _first_byte_s(self, turn: Turn) -> float:
        """A push pair's D first waits for P's prefill and WRITE: the pair's own deadline (push_leg.py)."""
        return turn.pair.decode_wait_s if turn.pair else self.settings.decode_first_byte_timeout_s

    async def _relay(self, turn: Turn, stream: EngineStream, sent: float) -> AsyncGenerator[bytes, None]:
        """Pass D's SSE events through as they come (as D's bytes where nothing needs editing: chunks.py), minus
        engine internals; record before `[DONE]`."""
        capture, began, first, recorded = DecodeCapture(cached_tokens=turn.cached_tokens), time.perf_counter(), \
            True, False
        decode = turn.decode
        decode.outstanding_requests += 1
        decode.running_kv_tokens += len(turn.req.prompt_ids)
        try:
            while (events := await stream.next_events()) is not None:
                if first:
                    decode.decoding_streams += 1         # D's headroom: a stream whose ITL a prefill would slow
                    _prefilled(turn)
                    turn.req.clock.decode_in()
                    self.outcome.release_held_back(turn)
                    self.outcome.observe("decode_ttft", began)
                    self._learn(turn, time.perf_counter() - sent)
                    first = False
                out, done = _frames(capture, events, turn.req)       # the events of one read go out in one write
                if out:
                    yield out
                if done:
                    break
            # a plan that asked D to hold nothing (push mode's all do) expects none
            if not capture.handle and capture.finished and turn.plan.hold:
                self.metrics.handles_missing.labels(Reason.HANDLE_NOT_STREAMED.value).inc()
            await self.outcome.record(turn, capture)
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
            _prefilled(turn)
            self.outcome.release_held_back(turn)
            decode.outstanding_requests -= 1
            decode.running_kv_tokens -= len(turn.req.prompt_ids)
            decode.decoding_streams -= 0 if first else 1
            turn.ticket.close()
            if not recorded:
                await _shielded(self.outcome.abandon(turn))


    def _learn(self, turn: Turn, seconds: float) -> None:
        """A streamed D leg's first token, for the path choice: the hand-over after P, or a local leg's fixed part
        (what it computed counts the local tokens D was prefilling ahead of it: a burst of first turns on D queued
        behind each other, which taught the later turns a fixed part of 100 ms and sent them all the P path)."""
        computed = len(turn.req.prompt_ids) - turn.reused_tokens
        prefill_rate = self.rates.prefill_rate(turn.prefill.url) if turn.prefill else None
        if turn.plan.local:
            prefill_rate = self.rates.any_prefill_rate()
            computed += turn.local_ahead
        self.rates.observe_decode(DecodeTiming(turn.decode.url, turn.plan.local, computed, seconds, time.monotonic()),
                                  prefill_rate)


def _prefilled(turn: Turn) -> None:
    """A local leg's tokens no longer count as D's prefill in flight, and a P-path leg's hand-over slot is free
    (its first token came, or it ended)."""
    if turn.handover is not None:
        turn.handover.release()
        turn.handover = None
    if turn.local_prefill is not None:
        engine, tokens = turn.local_prefill
        engine.local_prefill_tokens -= tokens
        engine.local_prefills -= 1
        turn.local_prefill = None


@contextlib.contextmanager
def _decoding(decode: Engine) -> Iterator[None]:
    """A JSON leg counts as decoding for all its life: nothing says when its first token came."""
    decode.decoding_streams += 1
    try:
        yield
    finally:
        decode.decoding_streams -= 1


def _frames(capture: DecodeCapture, events: list[bytes], req: TurnRequest) -> tuple[bytes, bool]:
    """The client's bytes for the events of one read, up to `[DONE]` (and whether it came)."""
    frames = []
    for event in events:
        if event == sse.DONE:
            return b"".join(frames), True
        frames.append(sse.frame(chunks.relay(capture, event, req.want_token_ids, req.decode_answer)))
    return b"".join(frames), False


async def _shielded(coro: Awaitable[None]) -> None:
    try:
        await asyncio.shield(coro)
    except (asyncio.CancelledError, Exception):  # a dying stream must not raise from its cleanup
        pass
