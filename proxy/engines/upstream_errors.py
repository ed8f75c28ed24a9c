"""A provider's failure as the error a client sees: `UpstreamError`, in OpenAI's shape.

Shared by both upstream paths: the direct OpenAI-compatible client (`proxy.engines.openai_compat`)
and litellm's (`proxy.engines.upstream.to_api_error`). A provider's 4xx keeps its status and
fields; anything else is the provider's failure (a 502; a 503 stays a 503). Every text a
provider wrote passes through the caller's `redact` first.

What it is not: it calls no provider and imports neither path, so each path may import it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from proxy.errors import APIError


class UpstreamError(APIError):
    """An error of the provider (or of reaching it), with the status the client should see."""

    def __init__(self, message: str, status_code: int, type: str, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.status_code = status_code
        self.type = type


def status_error(
    status: int, detail: Mapping[str, Any], redact: Callable[[str], str]
) -> UpstreamError:
    """A provider's HTTP status and error object (`{"message", "type", "param", "code"}`) as the
    client's error: a 4xx keeps its status and fields, anything else is the provider's failure
    (a 502; a 503 stays a 503). Every text passes through `redact`."""
    clean = {k: redact(v) if isinstance(v, str) else v for k, v in detail.items()}
    message = str(clean.get("message") or f"HTTP {status}")
    if 400 <= status < 500:
        kind = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}
        return UpstreamError(
            message,
            status,
            str(clean.get("type") or kind.get(status, "invalid_request_error")),
            param=clean.get("param") if isinstance(clean.get("param"), str) else None,
            code=str(clean["code"]) if clean.get("code") is not None else None,
        )
    return UpstreamError(
        f"The upstream provider failed: {message}",
        503 if status == 503 else 502,
        "server_error",
        code="upstream_error",
    )
