"""D's streamed leg as the gateway reads it: SSE payloads cut from any split of the bytes (the fast path for reads
of whole frames says what the general parser says), and D's idle deadline (one watchdog per stream) fails a
read that waits too long while a slow but steady stream goes on. Real HTTP on loopback, the gateway's client."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from gateway.engines import sse
from gateway.engines.client import EngineClient, EngineStream
from gateway.errors import EngineTimeoutError

_payload = st.binary(max_size=40).filter(lambda b: b"\n" not in b and b"\r" not in b)
_frame = st.one_of(_payload.map(lambda p: b"data: " + p + b"\n\n"),
                   _payload.map(lambda p: b"data:" + p + b"\n\n"),               # no space after the colon
                   _payload.map(lambda p: b"data:  " + p + b"\n\n"),             # two
                   st.tuples(_payload, _payload).map(lambda t: b"data: " + t[0] + b"\ndata: " + t[1] + b"\n\n"),
                   _payload.map(lambda p: b": keep-alive " + p + b"\n\n"),       # a comment
                   _payload.map(lambda p: b"event: x\ndata: " + p + b"\n\n"))


def _general(stream: bytes) -> list[bytes]:
    """What the general parser makes of a whole stream fed at once after a byte that forces it (see below)."""
    splitter = sse.EventSplitter()
    splitter.feed(b"\n")             # a leading stray newline: the buffer is never empty, no fast path
    return splitter.feed(stream)


@given(st.lists(_frame, max_size=8), st.lists(st.integers(min_value=0, max_value=400), max_size=6))
def test_any_split_of_the_bytes_gives_the_general_parsers_events(frames: list[bytes], cuts: list[int]) -> None:
    stream = b"".join(frames)
    bounds = sorted({0, len(stream), *(c for c in cuts if c < len(stream))})
    splitter, events = sse.EventSplitter(), []
    for a, b in zip(bounds, bounds[1:]):
        events += splitter.feed(stream[a:b])
    assert events == _general(stream)


def test_whole_frames_are_cut_by_the_fast_path() -> None:
    assert sse.EventSplitter().feed(b'data: {"a":1}\n\ndata: [DONE]\n\n') == [b'{"a":1}', b"[DONE]"]
    assert sse.EventSplitter().feed(b"data: \n\n") == [b""]


async def _served(body: Callable[[web.StreamResponse], AsyncIterator[None]], idle_s: float,
                  use: Callable[[EngineStream], object]) -> object:
    async def answer(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        async for _ in body(response):
            pass
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        async with aiohttp.ClientSession() as session:
            stream = await EngineClient(session).open_stream(url, "/v1/chat/completions", {},
                                                             first_byte_timeout_s=5, idle_timeout_s=idle_s)
            try:
                return await use(stream)
            finally:
                stream.close()
    finally:
        await runner.cleanup()


async def _all(stream: EngineStream) -> list[bytes]:
    events = []
    while (got := await stream.next_events()) is not None:
        events += got
    return events


def test_a_stream_that_stalls_fails_with_the_idle_timeout() -> None:
    async def body(response: web.StreamResponse) -> AsyncIterator[None]:
        await response.write(b"data: 1\n\n")
        yield None
        await asyncio.sleep(3)          # stalls far past the deadline

    async def use(stream: EngineStream) -> float:
        assert await stream.next_events() == [b"1"]
        began = asyncio.get_running_loop().time()
        with pytest.raises(EngineTimeoutError):
            await stream.next_events()
        return asyncio.get_running_loop().time() - began
    waited = asyncio.run(_served(body, 0.3, use))
    assert 0.25 <= waited < 1.5


def test_a_slow_steady_stream_outlives_its_idle_timeout() -> None:
    async def body(response: web.StreamResponse) -> AsyncIterator[None]:
        for i in range(8):              # 8 gaps of 0.1 s: 0.8 s in all, each gap well inside 0.3 s
            await response.write(b"data: %d\n\n" % i)
            await asyncio.sleep(0.1)
            yield None
        await response.write(b"data: [DONE]\n\n")

    assert asyncio.run(_served(body, 0.3, _all)) == [b"%d" % i for i in range(8)] + [b"[DONE]"]


def test_a_reader_that_is_slow_itself_is_not_a_stall() -> None:
    """The deadline counts only the wait for D: time the relay spends elsewhere (a slow client) is not D's."""
    async def body(response: web.StreamResponse) -> AsyncIterator[None]:
        for i in range(3):
            await response.write(b"data: %d\n\n" % i)
            yield None
        await response.write(b"data: [DONE]\n\n")

    async def use(stream: EngineStream) -> list[bytes]:
        events = []
        while (got := await stream.next_events()) is not None:
            events += got
            await asyncio.sleep(0.5)    # longer than the idle timeout, between reads
        return events
    assert asyncio.run(_served(body, 0.3, use)) == [b"0", b"1", b"2", b"[DONE]"]
