"""The gateway's one error tree; each error knows its HTTP status and OpenAI error `type`/`code`.

    GatewayError
    ├── ClientError                  4xx: the request itself is wrong; retrying it unchanged will not help
    │   ├── InvalidRequestError      400 invalid_request_error (names the offending field in `param`)
    │   ├── AuthenticationError      401 invalid_api_key
    │   ├── NotFoundError            404 not_found
    │   ├── ModelNotFoundError       404 model_not_found
    │   └── RequestTooLargeError     413 request_too_large
    ├── OverloadedError              429 rate_limit_exceeded, with Retry-After: the gateway is at its bounds
    └── UpstreamError                5xx: an engine failed; the request may succeed later
        ├── EngineFailedError        502 upstream_error: an engine answered with an error or garbage
        ├── EngineUnavailableError   503 engine_unavailable: no healthy engine, or it refused the connection
        │   └── EngineConnectError   the connection was refused: the engine never saw the request
        └── EngineTimeoutError       504 upstream_timeout: an engine missed its deadline

Engine bodies, hosts and ports never appear in `message`: they stay in the logs.
"""

from __future__ import annotations


class GatewayError(Exception):
    status: int = 500
    type: str = "internal_error"
    code: str = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ClientError(GatewayError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request_error"


class InvalidRequestError(ClientError):
    pass


class AuthenticationError(ClientError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class NotFoundError(ClientError):
    status = 404
    code = "not_found"


class ModelNotFoundError(ClientError):
    status = 404
    code = "model_not_found"


class RequestTooLargeError(ClientError):
    status = 413
    code = "request_too_large"


class OverloadedError(GatewayError):
    status = 429
    type = "rate_limit_error"
    code = "rate_limit_exceeded"


class UpstreamError(GatewayError):
    status = 502
    type = "upstream_error"
    code = "upstream_error"


class EngineFailedError(UpstreamError):
    pass


class EngineUnavailableError(UpstreamError):
    status = 503
    code = "engine_unavailable"


class EngineConnectError(EngineUnavailableError):
    pass


class EngineTimeoutError(UpstreamError):
    status = 504
    code = "upstream_timeout"
