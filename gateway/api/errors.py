"""Every error leaves the gateway in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import logging

from litestar import Request, Response
from litestar.exceptions import HTTPException

from gateway.errors import GatewayError

log = logging.getLogger("gateway.api")

_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large", 429: "rate_limited"}


def error_response(status: int, message: str, type_: str, code: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> Response:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return Response(body, status_code=status, media_type="application/json", headers=headers)


def gateway_error(_: Request, exc: GatewayError) -> Response:
    return error_response(exc.status, exc.message, exc.type, exc.code, exc.param, exc.headers)


def http_error(_: Request, exc: HTTPException) -> Response:
    status = exc.status_code
    message = "request body too large" if status == 413 else str(exc.detail)
    return error_response(status, message, "invalid_request_error" if status < 500 else "internal_error",
                          _HTTP_CODES.get(status, "invalid_request_error" if status < 500 else "internal_error"))


def unexpected_error(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s", request.url.path)
    return error_response(500, "internal gateway error", "internal_error", "internal_error")


HANDLERS = {GatewayError: gateway_error, HTTPException: http_error, Exception: unexpected_error}
