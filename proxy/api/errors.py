"""rlproxy's API errors, and the one helper that renders them in OpenAI's shape.

    APIError                      an error a client sees: status, message, type, param, code
    ├── InvalidRequestError       400 invalid_request_error (code e.g. "invalid_value")
    │   └── ContextLengthError    400, code "context_length_exceeded"
    ├── NotFoundError             404 invalid_request_error, code e.g. "adapter_not_found"
    │   └── ModelNotFoundError    404, code "model_not_found"
    ├── ServerError               500 server_error (the engine failed; retrying may help)
    └── UpstreamError             the provider's status (proxy.engines.upstream)

Errors are raised anywhere below the routes and rendered only at the HTTP edge, as
`{"error": {"message", "type", "param", "code"}}` with a string code. A deterministic failure
(bad input) is always a 4xx: clients retry 5xx.
"""

from __future__ import annotations

from typing import Any


class APIError(Exception):
    status_code = 500
    type = "server_error"
    default_code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code or self.default_code

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


class InvalidRequestError(APIError):
    status_code = 400
    type = "invalid_request_error"
    default_code = "invalid_value"


class ContextLengthError(InvalidRequestError):
    default_code = "context_length_exceeded"


class NotFoundError(APIError):
    status_code = 404
    type = "invalid_request_error"
    default_code = "not_found"


class ModelNotFoundError(NotFoundError):
    default_code = "model_not_found"

    def __init__(self, model: str):
        super().__init__(
            f"The model `{model}` does not exist or you do not have access to it.", param="model"
        )


class ServerError(APIError):
    status_code = 500
    type = "server_error"
    default_code = "server_error"


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
