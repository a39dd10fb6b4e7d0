"""Run an ASGI app with uvicorn on sockets bound here, so `--port 0` works and the real port can be reported; with
the deadlines and the connection cap of gateway/connections.py, and the metrics listener (`--metrics-port`)."""

from __future__ import annotations

import socket
from pathlib import Path

import uvicorn

from gateway.connections import Limits, protocol

KEEP_ALIVE_S = 75


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket whose connections send small writes at once. asyncio sets TCP_NODELAY only on
    sockets made with proto IPPROTO_TCP (socket.socket() makes proto 0), and without it a response written in
    two parts waits for the client's delayed ACK: 40 ms on Linux. Accepted sockets inherit both settings."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    return sock


def serve(app, host: str, port: int, *, port_file: str | None = None, log_level: str = "info",
          limits: Limits | None = None, keep_alive_s: float = KEEP_ALIVE_S, metrics_port: int | None = None) -> None:
    """`limits`: slow clients' deadlines and the connection cap (None: uvicorn's own protocol, no deadlines).
    `metrics_port`: a second listener on the same host, told apart by the app (gateway/api/operational.py)."""
    sock = bind(host, port)
    sockets = [sock] + ([bind(host, metrics_port)] if metrics_port else [])
    # log_config=None: uvicorn's records go through the root handler, so --log-format json covers them too.
    # Keep-alive longer than clients' and load balancers' idle timeouts, so the gateway is never the side
    # that closes an idle connection just as a request is being written on it.
    config = uvicorn.Config(app, loop="uvloop", http=protocol(limits) if limits else "httptools",
                            log_level=log_level, access_log=False, timeout_keep_alive=keep_alive_s,
                            lifespan="on", timeout_graceful_shutdown=5, log_config=None)
    server = uvicorn.Server(config)
    if port_file:
        _announce_when_started(server, Path(port_file), sock.getsockname()[1])
    server.run(sockets=sockets)


def _announce_when_started(server: uvicorn.Server, path: Path, port: int) -> None:
    """Write the port only once the lifespan ran and the socket accepts: readers may connect at once."""
    startup = server.startup

    async def startup_then_announce(sockets=None):
        await startup(sockets=sockets)
        path.write_text(str(port))

    server.startup = startup_then_announce
