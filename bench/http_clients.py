"""Which pooled async HTTP client should the gateway use for its engine legs? Same server, same load, one run.

python bench/http_clients.py [--requests 3000] [--concurrency 1,32]
Prints per-client requests/s and p50/p99 latency for a small JSON POST and a 64-chunk SSE stream.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import threading
import time

import aiohttp
import httpx
import uvicorn

BODY = b'{"model":"demo","messages":[{"role":"user","content":"hi"}],"max_tokens":1}'
REPLY = b'{"id":"x","choices":[{"index":0,"text":"a"}],"kv_transfer_params":{"remote_block_ids":[[1,2,3]]}}'
CHUNKS = 64


async def asgi(scope, receive, send):
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    stream = scope["path"] == "/stream"
    ctype = b"text/event-stream" if stream else b"application/json"
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", ctype)]})
    if not stream:
        await send({"type": "http.response.body", "body": REPLY})
        return
    for _ in range(CHUNKS):
        await send({"type": "http.response.body", "body": b"data: " + REPLY + b"\n\n", "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})


def serve() -> int:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(asgi, log_level="error", loop="uvloop", http="httptools")
    threading.Thread(target=lambda: uvicorn.Server(config).run(sockets=[sock]), daemon=True).start()
    time.sleep(1.0)
    return sock.getsockname()[1]


async def run_aiohttp(url: str, n: int, conc: int, stream: bool) -> list[float]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one() -> float:
            t = time.perf_counter()
            async with session.post(url, data=BODY, headers={"content-type": "application/json"}) as r:
                if stream:
                    async for _ in r.content:
                        pass
                else:
                    await r.read()
            return time.perf_counter() - t
        return await _drive(one, n, conc)


async def run_httpx(url: str, n: int, conc: int, stream: bool) -> list[float]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(limits=limits, timeout=30) as client:
        async def one() -> float:
            t = time.perf_counter()
            async with client.stream("POST", url, content=BODY, headers={"content-type": "application/json"}) as r:
                if stream:
                    async for _ in r.aiter_lines():
                        pass
                else:
                    await r.aread()
            return time.perf_counter() - t
        return await _drive(one, n, conc)


async def _drive(one, n: int, conc: int) -> list[float]:
    lat: list[float] = []
    remaining = iter(range(n))

    async def worker() -> None:
        for _ in remaining:
            lat.append(await one())
    await asyncio.gather(*(worker() for _ in range(conc)))
    return lat


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--concurrency", default="1,32")
    args = ap.parse_args()
    port = serve()
    for path in ("/json", "/stream"):
        for conc in map(int, args.concurrency.split(",")):
            rates = {}
            for name, fn in (("aiohttp", run_aiohttp), ("httpx", run_httpx)):
                t = time.perf_counter()
                lat = asyncio.run(fn(f"http://127.0.0.1:{port}{path}", args.requests, conc, path == "/stream"))
                rates[name] = args.requests / (time.perf_counter() - t)
                q = statistics.quantiles(lat, n=100)
                print(f"{path:8} c={conc:<3} {name:8} {rates[name]:8.0f} req/s  p50={q[49]*1e3:.2f}ms p99={q[98]*1e3:.2f}ms")
            print(f"{path:8} c={conc:<3} aiohttp/httpx throughput ratio {rates['aiohttp'] / rates['httpx']:.2f}")


if __name__ == "__main__":
    main()
