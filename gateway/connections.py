"""Slow and stuck clients, and what the HTTP layer refuses, for the gateway's uvicorn (issue 38).

uvicorn times only an idle keep-alive connection: a client that connects and sends half its headers, or
announces `Content-Length: 100000` and sends ten bytes, holds its socket (a file descriptor, buffers) for ever,
and a few thousand such sockets take a replica down. Its protocol class is a documented seam
(`uvicorn.Config(http=...)`), so this subclass of its httptools protocol adds what it lacks:

    header deadline    a request's headers must be complete this long after its first byte (or after connecting)
    body deadline      its whole body this long after its headers: a total, so a byte a second does not extend it
    connection cap     connections above it are answered 503 and closed at once
    malformed request  llhttp's refusal (bare CR or LF, NUL, folded headers, bytes 0x7f-0xff in a header...) as
                       the API's error body, not uvicorn's text/plain 400

A late request gets 408 (503 over the cap) in the API's error shape, then the connection is closed. What stays
the server's own: a client that stops reading a response (the kernel's send buffer, then asyncio's transport
buffer with uvicorn's flow control), and TLS (none here: a proxy in front terminates it).
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from dataclasses import dataclass

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("gateway.connections")

# Left to the engines' pool, the store and the log files when the cap is derived from the open-file limit.
RESERVED_FDS = 256


@dataclass(frozen=True)
class Limits:
    header_timeout_s: float
    body_timeout_s: float
    max_connections: int


def default_max_connections() -> int:
    """The process's open-file limit, less what the engines and the store need: past it accept() fails anyway."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return max(64, (soft if soft != resource.RLIM_INFINITY else 65536) - RESERVED_FDS)


def error_bytes(status: int, reason: str, message: str, code: str, anthropic: bool = False) -> bytes:
    """A whole HTTP/1.1 response, closing the connection, with the API's error body (Anthropic's on /v1/messages)."""
    kind = "invalid_request_error" if status < 500 else "overloaded_error" if anthropic else "server_error"
    error = {"type": kind, "message": message} if anthropic else \
        {"message": message, "type": kind, "param": None, "code": code}
    body = json.dumps({"type": "error", "error": error} if anthropic else {"error": error}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode() + body


def protocol(limits: Limits) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol with `limits`: pass as `uvicorn.Config(http=protocol(limits))`."""
    return type("LimitedHttpToolsProtocol", (LimitedHttpToolsProtocol,), {"limits": limits})


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    limits: Limits
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            log.warning("connection refused: %d open, the cap is %d (--max-connections)", len(self.connections),
                        self.limits.max_connections)
            self._refuse(503, "Service Unavailable", "too many connections to this gateway replica",
                         "too_many_connections")
            return
        self._arm(self.limits.header_timeout_s, self._headers_late)     # until its first request's headers

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm(self.limits.header_timeout_s, self._headers_late)

    def on_headers_complete(self) -> None:
        self._arm(self.limits.body_timeout_s, self._body_late)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def send_400_response(self, msg: str) -> None:
        """llhttp refused the request's bytes: the API's error body instead of uvicorn's text."""
        self._disarm()
        self.transport.write(error_bytes(400, "Bad Request", "malformed HTTP request: the request line or a "
                                         "header is not valid HTTP/1.1", "malformed_http_request",
                                         self._anthropic()))
        self.transport.close()

    def _arm(self, delay_s: float, then) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(delay_s, then)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _headers_late(self) -> None:
        self._deadline = None
        if self.cycle is not None and not self.cycle.response_complete:
            # a response in progress (a stream) with the next request's first bytes behind it (pipelined): that
            # request's headers are timed again once this one is answered, not cut off in the middle of it
            self._arm(self.limits.header_timeout_s, self._headers_late)
            return
        self._refuse(408, "Request Timeout", f"the request's headers did not arrive within "
                     f"{self.limits.header_timeout_s:g} s", "request_timeout")

    def _body_late(self) -> None:
        self._deadline = None
        cycle = self.cycle
        if cycle is None or cycle.response_started:     # answered without its body (401...): only close
            self.transport.close()
            return
        cycle.disconnected = True           # the handler reading the body sees a disconnect, sends nothing
        cycle.message_event.set()
        self._refuse(408, "Request Timeout", f"the request body did not arrive within "
                     f"{self.limits.body_timeout_s:g} s of its headers", "request_timeout")

    def _refuse(self, status: int, reason: str, message: str, code: str) -> None:
        if self.transport.is_closing():
            return
        self.transport.write(error_bytes(status, reason, message, code, self._anthropic()))
        self.transport.close()

    def _anthropic(self) -> bool:
        return (getattr(self, "url", None) or b"").startswith(b"/v1/messages")
