"""A recording reverse proxy on loopback between an agent harness and the gateway: each request's path, body,
status and the gateway's X-PD-* answer headers, so a test sees every request the harness made and what the
gateway did with it. It passes bytes through untouched (bodies, SSE streams, encodings) and adds nothing."""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "upgrade"}
MODEL_PATHS = ("/v1/messages", "/v1/responses", "/v1/chat/completions")


@dataclass
class Exchange:
    method: str
    path: str
    status: int
    headers: dict[str, str]                 # the gateway's answer headers, names in lower case
    body: dict[str, Any] = field(default_factory=dict)   # the request's JSON ({} if none or not JSON)

    @property
    def model_call(self) -> bool:
        return self.method == "POST" and self.path.split("?")[0] in MODEL_PATHS

    @property
    def plan(self) -> str:
        return self.headers.get("x-pd-plan", "")

    @property
    def reason(self) -> str:
        return self.headers.get("x-pd-reason", "")

    @property
    def reused(self) -> int:
        return int(self.headers.get("x-pd-reused-tokens") or 0)

    def __str__(self) -> str:
        return f"{self.method} {self.path} {self.status} {self.plan}/{self.reason} reused={self.reused}"


class Recorder:
    """`with Recorder(gateway_url) as rec:` point the harness at `rec.url`; `rec.exchanges` afterwards."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.exchanges: list[Exchange] = []
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None
        self._http: aiohttp.ClientSession | None = None

    def __enter__(self) -> Recorder:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)

    @property
    def model_calls(self) -> list[Exchange]:
        return [e for e in self.exchanges if e.model_call]

    async def _start(self) -> None:
        self._http = aiohttp.ClientSession(auto_decompress=False, timeout=aiohttp.ClientTimeout(total=300))
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._http is not None:
            await self._http.close()

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        assert self._http is not None
        async with self._http.request(request.method, self.upstream + request.path_qs, data=raw,
                                      headers=headers) as upstream:
            self.exchanges.append(Exchange(request.method, request.path_qs, upstream.status,
                                           {k.lower(): v for k, v in upstream.headers.items()}, _json(raw)))
            response = web.StreamResponse(status=upstream.status, headers={
                k: v for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP})
            await response.prepare(request)
            try:
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
            except ConnectionResetError:        # the harness hung up once it had what it wanted (Codex does)
                pass
            return response


def _json(raw: bytes) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
