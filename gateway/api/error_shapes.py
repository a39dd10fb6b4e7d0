"""Every error leaves the gateway in its API's shape: OpenAI's {"error": {"message", "type", "param", "code"}},
or Anthropic's {"type": "error", "error": {"type", "message"}} on every `/v1/messages*` path (matched or not, so
a wrong method or subpath answers the anthropic SDK in its own terms). A refused request (4xx) is logged at info
with the field that caused it and counted in `pdgw_rejected_total{api,reason}`."""

from __future__ import annotations

import logging

from litestar import Request, Response
from litestar.exceptions import HTTPException

from gateway.errors import GatewayError

log = logging.getLogger("gateway.api")

_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large", 429: "rate_limited"}
# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors)
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                    429: "rate_limit_error", 503: "overloaded_error"}
_APIS = (("/v1/chat/completions", "chat"), ("/v1/completions", "completions"), ("/v1/responses", "responses"),
         ("/v1/messages", "messages"), ("/admin/", "admin"))


def error_response(status: int, message: str, type_: str, code: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> Response:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return Response(body, status_code=status, media_type="application/json", headers=headers)


def anthropic_error(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return Response({"type": "error", "error": {"type": kind, "message": message}}, status_code=status,
                    media_type="application/json", headers=headers)


def api_of(path: str) -> str:
    return next((name for prefix, name in _APIS if path.startswith(prefix)), "other")


def gateway_error(request: Request, exc: GatewayError) -> Response:
    _rejected(request, exc.status, exc.code, exc.message, exc.param)
    if api_of(request.url.path) == "messages":
        return anthropic_error(exc.status, exc.message, exc.headers)
    return error_response(exc.status, exc.message, exc.type, exc.code, exc.param, exc.headers)


def http_error(request: Request, exc: HTTPException) -> Response:
    status = exc.status_code
    message = "request body too large" if status == 413 else str(exc.detail)
    code = _HTTP_CODES.get(status, "invalid_request_error" if status < 500 else "internal_error")
    _rejected(request, status, code, message, None)
    if api_of(request.url.path) == "messages":
        return anthropic_error(status, message)
    return error_response(status, message, "invalid_request_error" if status < 500 else "internal_error", code)


def unexpected_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s", request.url.path)
    if api_of(request.url.path) == "messages":
        return anthropic_error(500, "internal gateway error")
    return error_response(500, "internal gateway error", "internal_error", "internal_error")


def _rejected(request: Request, status: int, code: str, message: str, param: str | None) -> None:
    """A client's fault (4xx): one info line naming the field, and the count by API and reason (the error code:
    a bounded set; the field goes to the log only, as its paths are not)."""
    if not 400 <= status < 500:
        return
    api = api_of(request.url.path)
    log.info("rejected api=%s status=%d reason=%s param=%s: %s", api, status, code, param or "-", message)
    metrics = getattr(request.app.state, "metrics", None)
    if metrics is not None:
        metrics.rejected.labels(api, code).inc()


HANDLERS = {GatewayError: gateway_error, HTTPException: http_error, Exception: unexpected_error}
