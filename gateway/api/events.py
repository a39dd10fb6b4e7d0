"""The SSE response: D's events relayed to the client straight through the ASGI server.

Litestar's `Stream` runs the body and a client-disconnect listener in an anyio task group; measured, that is
about 90 µs of the gateway's CPU per streamed turn (bench/README.md). Here the body is sent from the
handler's own task and only the listener is a task of its own: when the client leaves, it cancels the relay,
whose `finally` closes D's stream (which aborts the request on D) and abandons the turn.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable

from litestar.types import Receive, Scope, Send

_START_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


class EventStream:
    """An ASGI app: a route handler annotated `-> ASGIApp` returns it and Litestar calls it as it is."""

    def __init__(self, frames: AsyncGenerator[bytes, None], headers: dict[str, str],
                 on_first_frame: Callable[[], None] | None = None) -> None:
        self._frames = frames
        self._on_first_frame = on_first_frame       # the turn's clock: the client's first byte is out
        self._headers = [*_START_HEADERS, *((k.lower().encode("latin-1"), v.encode("latin-1"))
                                            for k, v in headers.items())]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self._headers})
        relay = asyncio.current_task()
        gone = asyncio.Event()
        listener = asyncio.create_task(_cancel_when_gone(receive, relay, gone))
        try:
            async for frame in self._frames:
                await send({"type": "http.response.body", "body": frame, "more_body": True})
                if self._on_first_frame is not None:
                    self._on_first_frame()
                    self._on_first_frame = None
            listener.cancel()              # the server reports a completed response as a disconnect too
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not gone.is_set():
                raise                      # cancelled from outside (shutdown): not ours to swallow
            relay.uncancel()               # the client left: nothing more to send, nobody to tell
        finally:
            listener.cancel()
            await self._frames.aclose()    # runs the relay's cleanup now, wherever it was suspended


async def _cancel_when_gone(receive: Receive, relay: asyncio.Task | None, gone: asyncio.Event) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    gone.set()
    if relay is not None:
        relay.cancel()
