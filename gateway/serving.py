"""Run an ASGI app with uvicorn on sockets bound here, so `--port 0` works and the real port can be reported; with
the deadlines and the connection cap of gateway/connections.py, and the metrics listener (`--metrics-port`)."""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

import uvicorn

from gateway.connections import Limits, protocol

KEEP_ALIVE_S = 75


def bind(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A listening TCP socket whose connections send small writes at once. asyncio sets TCP_NODELAY only on
    sockets made with proto IPPROTO_TCP (socket.socket() makes proto 0), and without it a response written in
    two parts waits for the client's delayed ACK: 40 ms on Linux. Accepted sockets inherit both settings.
    `reuse_port`: several processes bind the port and the kernel spreads new connections over those listening
    (gateway/workers.py)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    return sock


def serve(app, host: str, port: int, *, started: Callable[[int], None] | None = None, log_level: str = "info",
          limits: Limits | None = None, keep_alive_s: float = KEEP_ALIVE_S, metrics_port: int | None = None,
          reuse_port: bool = False) -> None:
    """`started(port)`: called once the app serves. `limits`: slow clients' deadlines and the connection cap
    (None: uvicorn's own protocol, no deadlines). `metrics_port`: a second listener on the same host, told apart
    by the app (gateway/api/operational.py). `reuse_port`: one of several workers on these ports."""
    sock = bind(host, port, reuse_port=reuse_port)
    sockets = [sock] + ([bind(host, metrics_port, reuse_port=reuse_port)] if metrics_port else [])
    # log_config=None: uvicorn's records go through the root handler, so --log-format json covers them too.
    # Keep-alive longer than clients' and load balancers' idle timeouts, so the gateway is never the side
    # that closes an idle connection just as a request is being written on it.
    config = uvicorn.Config(app, loop="uvloop", http=protocol(limits) if limits else "httptools",
                            log_level=log_level, access_log=False, timeout_keep_alive=keep_alive_s,
                            lifespan="on", timeout_graceful_shutdown=5, log_config=None)
    server = uvicorn.Server(config)
    if started:
        _announce_when_started(server, started, sock.getsockname()[1])
    server.run(sockets=sockets)


def write_port(path: str) -> Callable[[int], None]:
    """`started` for `--port-file`: readers may connect as soon as the file has the port."""
    return lambda port: Path(path).write_text(str(port))


def _announce_when_started(server: uvicorn.Server, started: Callable[[int], None], port: int) -> None:
    """Announce the port only once the lifespan ran and the socket accepts."""
    startup = server.startup

    async def startup_then_announce(sockets=None):
        await startup(sockets=sockets)
        if not server.should_exit:          # a lifespan that failed at start-up announces nothing
            started(port)

    server.startup = startup_then_announce
