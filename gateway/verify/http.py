"""The wire for `pd-gateway verify`: JSON and SSE requests to the gateway and the engines, each answer whole
(status, headers, body or streamed chunks). A connection failure is an answer too (status 0): verify reports
it, it does not crash on it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import aiohttp


@dataclass
class Answer:
    status: int                                   # 0: no HTTP answer at all (refused, timed out)
    headers: dict[str, str] = field(default_factory=dict)   # lower-cased names
    body: Any = None                              # decoded JSON, else the text
    chunks: list[Any] | None = None               # a streamed answer's SSE payloads, decoded
    error: str = ""


class Wire:
    def __init__(self, session: aiohttp.ClientSession, timeout_s: float) -> None:
        self._session, self._timeout = session, aiohttp.ClientTimeout(total=timeout_s)

    async def post(self, url: str, path: str, body: dict[str, Any], headers: dict[str, str] | None = None,
                   ) -> Answer:
        try:
            async with self._session.post(url.rstrip("/") + path, json=body, headers=headers,
                                          timeout=self._timeout) as resp:
                out = Answer(resp.status, {k.lower(): v for k, v in resp.headers.items()})
                if body.get("stream") and resp.status == 200:
                    out.chunks = await _events(resp)
                else:
                    out.body = _decoded(await resp.read())
                return out
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            return Answer(0, error=f"{type(exc).__name__}: {exc}"[:300])

    async def get(self, url: str, path: str, headers: dict[str, str] | None = None) -> Answer:
        return await self._plain("GET", url, path, headers)

    async def delete(self, url: str, path: str, headers: dict[str, str] | None = None) -> Answer:
        return await self._plain("DELETE", url, path, headers)

    async def _plain(self, method: str, url: str, path: str, headers: dict[str, str] | None) -> Answer:
        try:
            async with self._session.request(method, url.rstrip("/") + path, headers=headers,
                                             timeout=self._timeout) as resp:
                return Answer(resp.status, {k.lower(): v for k, v in resp.headers.items()},
                              _decoded(await resp.read()))
        except (aiohttp.ClientError, TimeoutError) as exc:
            return Answer(0, error=f"{type(exc).__name__}: {exc}"[:300])


async def _events(resp: aiohttp.ClientResponse) -> list[Any]:
    chunks = []
    async for line in resp.content:
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data and data != b"[DONE]":
            chunks.append(_decoded(data))
    return chunks


def _decoded(raw: bytes) -> Any:
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return raw.decode("utf-8", "replace")
