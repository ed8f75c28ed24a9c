"""rlproxy's API errors, and the one helper that renders them in OpenAI's shape.

    APIError                      an error a client sees: status, message, type, param, code
    ├── InvalidRequestError       400 invalid_request_error (code e.g. "invalid_value")
    │   └── ContextLengthError    400, code "context_length_exceeded"
    ├── NotFoundError             404 invalid_request_error, code e.g. "adapter_not_found"
    │   └── ModelNotFoundError    404, code "model_not_found"
    ├── RateLimitError            429 requests, code "rate_limit_exceeded", with `retry-after`
    │   └── OverloadedError       429, code "server_overloaded" (the engine's queue is full)
    ├── ServerError               500 server_error (the engine failed; retrying may help)
    ├── BadGatewayError           502 server_error, code "engine_failed" (the engine server
    │                             generating the answer died mid-answer)
    ├── EngineUnreachableError    503 server_error, code "engine_unavailable" (no engine
    │                             server can take the request now)
    ├── StorageUnavailableError   503 server_error, code "storage_unavailable" (the database
    │                             takes no writes: a call could not be stored, so none is made)
    └── UpstreamError             the provider's status (proxy.engines.upstream_errors)

Errors are raised anywhere below the routes (this module imports nothing of rlproxy, so chat,
engines, adapters and protocols all may) and rendered only at the HTTP edge (`proxy.api.app`;
`proxy.api.error_shapes` for Anthropic's paths), as `{"error": {"message", "type", "param",
"code"}}` with a string code. A deterministic failure (bad input) is always a 4xx: clients retry
5xx. A 429 is retried too: the openai SDK raises `openai.RateLimitError` and waits for
`retry-after` before trying again.
"""

from __future__ import annotations

import math
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

    @property
    def headers(self) -> dict[str, str]:
        """Headers the response carries beside the body (e.g. `retry-after`)."""
        return {}


class InvalidRequestError(APIError):
    status_code = 400
    type = "invalid_request_error"
    default_code = "invalid_value"


class ContextLengthError(InvalidRequestError):
    """The prompt, or the prompt and the budget asked for, do not fit the model's context
    (`proxy.chat.budget`). The figures let each protocol's edge say it in its own words."""

    default_code = "context_length_exceeded"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        prompt_tokens: int = 0,
        max_context: int = 0,
        requested: int | None = None,
        at_least: bool = False,
    ):
        super().__init__(message, param=param)
        self.prompt_tokens = prompt_tokens
        """The prompt's tokens (`at_least`: more than this many, counted without tokenizing)."""
        self.max_context = max_context
        self.requested = requested
        """The budget asked for, when it is what did not fit (RLPROXY_OUTPUT_BUDGET=strict)."""
        self.at_least = at_least


LONG_CONTEXT_MODEL = "Qwen/Qwen2.5-0.5B-Instruct"
LONG_CONTEXT_TOKENS = 32_768
"""A base model with a longer context than the embedded SmolLM2-135M's 8,192 tokens that a laptop
runs (0.5B parameters, about 2 GB in fp32; its config's `max_position_embeddings`): the example
`longer_context` names."""


def longer_context(context: int) -> str:
    """What to do about a prompt a model of `context` tokens cannot hold, besides shortening it,
    in one line: every protocol's refusal and `rlproxy status` say it. It names a model to serve,
    LONG_CONTEXT_MODEL, when that model's context is the longer."""
    setting = "RLPROXY_BASE_MODEL: a Hugging Face id or a local model folder"
    if context >= LONG_CONTEXT_TOKENS:
        return f"serve a base model with a longer context ({setting})"
    return (
        f"serve a base model with a longer context, e.g. RLPROXY_BASE_MODEL={LONG_CONTEXT_MODEL} "
        f"rlproxy serve ({LONG_CONTEXT_TOKENS:,} tokens; {setting})"
    )


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


class RateLimitError(APIError):
    """Too many requests now: OpenAI's 429 (type "requests", code "rate_limit_exceeded").

    `retry_after_s` becomes the `retry-after` header (whole seconds, at least 1), which the
    openai SDK honours before its automatic retry.
    """

    status_code = 429
    type = "requests"
    default_code = "rate_limit_exceeded"

    def __init__(self, message: str, *, retry_after_s: float, code: str | None = None):
        super().__init__(message, code=code)
        self.retry_after_s = max(1, math.ceil(retry_after_s))

    @property
    def headers(self) -> dict[str, str]:
        return {"retry-after": str(self.retry_after_s)}


class OverloadedError(RateLimitError):
    """The server as a whole is at capacity (the engine's queue is full), not this caller.

    A 429 rather than OpenAI's 503 for an overloaded engine: it is refused before any work, so
    retrying is always safe, and a 4xx tells clients and monitors that nothing failed (the
    openai SDK retries both, honouring `retry-after`). TGI answers its own "model is
    overloaded" with a 429 too.
    """

    default_code = "server_overloaded"


class ServerError(APIError):
    status_code = 500
    type = "server_error"
    default_code = "server_error"


class BadGatewayError(APIError):
    """The engine server generating this answer failed mid-answer (a vLLM replica died): the
    call is stored as failed and nothing of it was acknowledged; a retry goes to a live one."""

    status_code = 502
    type = "server_error"
    default_code = "engine_failed"


class EngineUnreachableError(APIError):
    """No engine server can take the request now (every vLLM replica is down or refused it)."""

    status_code = 503
    type = "server_error"
    default_code = "engine_unavailable"

    @property
    def headers(self) -> dict[str, str]:
        return {"retry-after": "1"}


class StorageUnavailableError(APIError):
    """The database cannot be written (disk full, read-only, unreachable): every call is stored
    before it is acknowledged, so none is served. Raised before generating when the store
    already knows (`storage.health`), and for a call generated before it found out."""

    status_code = 503
    type = "server_error"
    default_code = "storage_unavailable"

    def __init__(self, why: str) -> None:
        """`why`: "the database cannot be written: disk full (...)" (`storage.health`)."""
        super().__init__(
            f"{why[:1].upper()}{why[1:]}. Every call is stored before it is answered, so this "
            "server answers none until the database can be written again; please retry later."
        )


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}
