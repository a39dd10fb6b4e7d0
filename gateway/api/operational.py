"""Who may call the operational paths (docs/operations.md#paths): `/metrics` and `/openapi.json` describe the
deployment, so with any key configured they need the admin key, or they move to a listener of their own
(`--metrics-port`, the common practice: bind it where only Prometheus reaches); `/health` and `/ready` stay open
everywhere and say nothing of engines.

The metrics listener serves the operational paths and nothing else: the API and the admin API are not on it."""

from __future__ import annotations

import hmac
from typing import Any

from litestar import Request
from litestar.types import ASGIApp, Receive, Scope, Send

from gateway.api.auth import ApiKeys
from gateway.config import Settings
from gateway.errors import AuthenticationError, NotFoundError

OPERATIONAL = frozenset({"/metrics", "/openapi.json", "/health", "/ready"})
_NOT_HERE = (b'{"error":{"message":"not served on the metrics listener","type":"invalid_request_error",'
             b'"param":null,"code":"not_found"}}')


def listener_port(scope: Scope | dict[str, Any]) -> int | None:
    """The port of the listening socket a request came in on (the ASGI server's `server` tuple)."""
    server = scope.get("server")
    return server[1] if server and len(server) > 1 else None


def authorize(request: Request, settings: Settings, api_keys: ApiKeys) -> None:
    """`/metrics`, `/openapi.json`: open on the metrics listener; on the API's, only the admin key may read them
    when any key is configured (open otherwise, as the whole gateway then is)."""
    if settings.metrics_port is not None:
        if listener_port(request.scope) == settings.metrics_port:
            return
        raise NotFoundError(f"{request.url.path} is served on the metrics listener (--metrics-port)")
    if not api_keys.enabled and not settings.admin_key:
        return
    if not settings.admin_key:
        raise AuthenticationError(f"{request.url.path} needs the admin key: set --admin-key, or --metrics-port "
                                  "for a listener of its own")
    given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
    if not hmac.compare_digest(given.encode(), settings.admin_key.encode()):
        raise AuthenticationError(f"{request.url.path} needs the admin key")


def metrics_listener(metrics_port: int | None):
    """ASGI middleware: on the metrics listener, anything but the operational paths is a 404."""
    def wrap(app: ASGIApp) -> ASGIApp:
        if metrics_port is None:
            return app

        async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http" or listener_port(scope) != metrics_port or scope["path"] in OPERATIONAL:
                await app(scope, receive, send)
                return
            await send({"type": "http.response.start", "status": 404,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(_NOT_HERE)).encode())]})
            await send({"type": "http.response.body", "body": _NOT_HERE})
        return guarded
    return wrap
