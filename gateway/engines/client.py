"""The vLLM wire client: JSON and SSE over a pooled aiohttp session it is given (so tests and the app own it).

Foreign errors are translated here, at the boundary, into the gateway's error tree.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import aiohttp
import msgspec

from gateway.engines import sse
from gateway.errors import (
    EngineConnectError,
    EngineFailedError,
    EngineTimeoutError,
    EngineUnavailableError,
    GatewayError,
    InvalidRequestError,
)

JSON_HEADERS = {"Content-Type": "application/json"}
# vLLM's API server (uvicorn) closes a connection idle for VLLM_HTTP_TIMEOUT_KEEP_ALIVE (5 s, vllm/envs.py);
# aiohttp keeps one for 15 s. A request written on a connection the engine is closing fails ("server
# disconnected", "connection reset": 502s under load on the simulators, which keep uvicorn's 5 s too). Closing
# idle connections first leaves no such race.
ENGINE_KEEPALIVE_S = 4.0


def engine_connector(keepalive_s: float = ENGINE_KEEPALIVE_S) -> aiohttp.TCPConnector:
    """The connection pool for engines: unbounded (admission bounds the turns), idle connections closed before
    the engines close them."""
    return aiohttp.TCPConnector(limit=0, ttl_dns_cache=300, keepalive_timeout=keepalive_s)
_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode


def _nothing() -> None:
    pass


class EngineStream:
    """An open streamed D response: iterate SSE payloads; always `close()` (closing aborts the request on D).

    D's idle deadline is one watchdog timer per stream, not a timeout scope per read: a read marks when it began
    waiting, and the watchdog, waking once per idle period, fails the read that has waited that long."""

    def __init__(self, response: aiohttp.ClientResponse, idle_timeout_s: float) -> None:
        self._response = response
        self._content = response.content
        self._idle = idle_timeout_s
        self._splitter = sse.EventSplitter()
        self._pending: list[bytes] = []
        self._loop = asyncio.get_running_loop()
        self._waiting_since: float | None = None     # when the read in progress began waiting for D
        self._watchdog: asyncio.TimerHandle | None = None

    async def next_events(self) -> list[bytes] | None:
        """Every event that came with the next read (at least one): relaying them together costs one write
        to the client, not one per event, and delays none. None at the end of the stream."""
        if self._pending:
            events, self._pending = self._pending, []
            return events
        if self._watchdog is None:
            self._watchdog = self._loop.call_later(self._idle, self._watch)
        while True:
            self._waiting_since = self._loop.time()
            try:
                chunk = await self._content.readany()
            except aiohttp.ClientError as exc:
                raise EngineFailedError("decode engine broke the stream") from exc
            finally:
                self._waiting_since = None
            if not chunk:
                return None
            if events := self._splitter.feed(chunk):
                return events

    def _watch(self) -> None:
        """The watchdog: fail a read that has waited `idle` for D, else look again when one could have."""
        since, now = self._waiting_since, self._loop.time()
        if since is not None and now - since >= self._idle:
            self._watchdog = None
            self._content.set_exception(EngineTimeoutError("decode engine stalled mid-stream"))
            return
        self._watchdog = self._loop.call_at((since if since is not None else now) + self._idle, self._watch)

    async def first_events(self, timeout_s: float) -> list[bytes]:
        """Wait up to `timeout_s` (not the idle timeout) for the stream's first events, kept for `next_events`.
        A push-mode D sends its headers at once and its first token only after P's prefill and WRITE
        (docs/protocol.md §8): that wait is P's, not a stall. An error event before any token is the request's
        failure (a failed KV load under `fail`, §7), raised here so that the leg can still be redone."""
        with _translated("decode engine sent no token in time"):
            async with asyncio.timeout(timeout_s):
                while not self._pending:
                    chunk = await self._response.content.readany()
                    if not chunk:
                        raise EngineFailedError("decode engine ended the stream before its first token")
                    self._pending = self._splitter.feed(chunk)
            first = self._pending[0]
            if first.startswith(b"{") and b'"error"' in first[:64] and "error" in _decode(first):
                raise EngineFailedError(f"decode engine failed before its first token: {_engine_message(first)}")
        return list(self._pending)

    def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None
        self._response.close()


class EngineClient:
    def __init__(self, session: aiohttp.ClientSession) -> None:
        self._session = session

    async def post_json(self, base_url: str, path: str, body: dict[str, Any], *, timeout_s: float,
                        headers: dict[str, str] | None = None,
                        decode: Callable[[bytes], dict[str, Any]] = _decode,
                        on_sent: Callable[[], None] = _nothing,
                        on_answer: Callable[[], None] = _nothing) -> dict[str, Any]:
        """`on_sent` runs once the body is encoded (the request goes out next), `on_answer` once its answer's
        bytes are in (before decoding): the gateway's own time is measured between such marks."""
        data = _encode(body)
        on_sent()
        with _translated("engine did not answer in time"):
            async with asyncio.timeout(timeout_s):
                async with self._session.post(base_url + path, data=data,
                                              headers={**JSON_HEADERS, **(headers or {})}) as resp:
                    payload = await resp.read()
                    on_answer()
                    _raise_for_status(resp.status, payload)
                    return decode(payload)

    async def open_stream(self, base_url: str, path: str, body: dict[str, Any], *, first_byte_timeout_s: float,
                          idle_timeout_s: float, headers: dict[str, str] | None = None,
                          on_sent: Callable[[], None] = _nothing) -> EngineStream:
        """POST a streaming request and wait for its response headers (so HTTP errors surface as errors)."""
        data = _encode(body)
        on_sent()
        with _translated("decode engine did not start streaming in time"):
            async with asyncio.timeout(first_byte_timeout_s):
                resp = await self._session.post(base_url + path, data=data,
                                                headers={**JSON_HEADERS, **(headers or {})})
                if resp.status >= 400:
                    payload = await resp.read()
                    resp.close()
                    _raise_for_status(resp.status, payload)
        return EngineStream(resp, idle_timeout_s)

    async def get(self, base_url: str, path: str, *, timeout_s: float) -> bytes:
        with _translated("engine did not answer in time"):
            async with asyncio.timeout(timeout_s):
                async with self._session.get(base_url + path) as resp:
                    payload = await resp.read()
                    _raise_for_status(resp.status, payload)
                    return payload


@contextlib.contextmanager
def _translated(timeout_message: str) -> Iterator[None]:
    """Foreign errors into the gateway's tree, at the boundary: a deadline, garbage, a broken connection."""
    try:
        yield
    except TimeoutError:
        raise EngineTimeoutError(timeout_message) from None
    except msgspec.DecodeError as exc:
        raise EngineFailedError("engine answered with malformed JSON") from exc
    except aiohttp.ClientError as exc:
        raise _connection_error(exc) from exc


def _raise_for_status(status: int, payload: bytes) -> None:
    if status < 400:
        return
    if 400 <= status < 500 and status != 404:
        # vLLM's 4xx are about the request (e.g. prompt longer than the context): the client should see them.
        raise InvalidRequestError(_engine_message(payload))
    raise EngineFailedError(f"engine answered HTTP {status}")


def _engine_message(payload: bytes) -> str:
    try:
        message = _decode(payload)["error"]["message"]
    except (msgspec.DecodeError, KeyError, TypeError):
        return "the engine rejected the request"
    return str(message)[:500]


def _connection_error(exc: aiohttp.ClientError) -> GatewayError:
    if isinstance(exc, aiohttp.ClientConnectorError):
        return EngineConnectError("engine unreachable")         # refused: the request was never sent
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return EngineUnavailableError("engine went away")       # it may have seen the request
    return EngineFailedError("engine connection failed")
