"""The baseline "what people run today": a minimal multi-turn P→D proxy in the style of vLLM's example proxies.

FastAPI + httpx, round robin over P and D, conversation state in a dict: the session's last D handle is handed
to P on the next turn, unchecked (no tokenizer, no continuity check, no store, no health, no metrics).
Written for the benchmark only; it is as careful as such a proxy usually is (one pooled client per engine,
streaming passed through as bytes, the handle fished out of the final chunk).

    python bench/naive_proxy.py --prefill http://P --decode http://D --port 0 --port-file F
"""

from __future__ import annotations

import argparse
import itertools
import json
import socket
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

FRESH = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
         "remote_block_ids": None, "remote_host": None, "remote_port": None}


def create_app(prefill: list[str], decode: list[str]) -> FastAPI:
    sessions: dict[str, dict] = {}            # session id → D's last handle

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        clients = [httpx.AsyncClient(base_url=u, timeout=None, limits=limits) for u in [*prefill, *decode]]
        app.state.prefill = itertools.cycle(clients[:len(prefill)])
        app.state.decode = itertools.cycle(clients[len(prefill):])
        yield
        for client in clients:
            await client.aclose()

    app = FastAPI(lifespan=lifespan)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        session = request.headers.get("x-session-id")
        p_req = dict(body, max_tokens=1, stream=False)
        p_req.pop("stream_options", None)
        p_req.pop("max_completion_tokens", None)
        p_req["kv_transfer_params"] = (sessions.pop(session, None) if session else None) or dict(FRESH)
        p_resp = await next(app.state.prefill).post("/v1/chat/completions", json=p_req)
        if p_resp.status_code != 200:
            return JSONResponse(p_resp.json(), status_code=p_resp.status_code)
        d_req = dict(body, kv_transfer_params=p_resp.json().get("kv_transfer_params"))
        d_client = next(app.state.decode)
        if not body.get("stream"):
            d_resp = await d_client.post("/v1/chat/completions", json=d_req)
            answer = d_resp.json()
            if session and answer.get("kv_transfer_params"):
                sessions[session] = answer["kv_transfer_params"]
            return JSONResponse(answer, status_code=d_resp.status_code)

        async def relay():
            pending = b""
            async with d_client.stream("POST", "/v1/chat/completions", json=d_req) as d_resp:
                async for chunk in d_resp.aiter_bytes():
                    yield chunk
                    if session:
                        *events, pending = (pending + chunk).split(b"\n\n")
                        for event in events:
                            remember(session, event)

        return StreamingResponse(relay(), media_type="text/event-stream")

    def remember(session: str, event: bytes) -> None:
        if event.startswith(b"data: {") and b"kv_transfer_params" in event:
            handle = json.loads(event[6:]).get("kv_transfer_params")
            if handle:
                sessions[session] = handle

    return app


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill", action="append", required=True)
    ap.add_argument("--decode", action="append", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--port-file")
    args = ap.parse_args()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    if args.port_file:
        Path(args.port_file).write_text(str(sock.getsockname()[1]))
    config = uvicorn.Config(create_app(args.prefill, args.decode), log_level="warning", access_log=False)
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    main()
