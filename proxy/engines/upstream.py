"""The `upstream` engine: a litellm client for the model names served by other providers.

    engine = UpstreamEngine(settings.upstream_models, timeout_s=600)
    response = await engine.acompletion(request)               # litellm's response object
    stream = await engine.acompletion(request, stream=True)    # litellm's chunk iterator

Each served name maps to a litellm target (`provider/model`, an optional `api_base`, and the name
of the server's environment variable holding the provider key: the key never comes from the
request). Provider exceptions become OpenAI-shaped errors with `UpstreamEngine.api_error` (a
provider 4xx keeps its status, an unreachable provider is a 502, a timeout a 504), scrubbed of
credentials first (`proxy.redact`): a provider that echoes the key it was sent must not hand the
server's key to a client, the database or a log.

Unlike the token-level engines (`base.Engine`), this one speaks messages: providers return no
token ids, so its calls are stored but cannot be trained on. Re-framing responses and recording
calls is `proxy.chat.upstream`'s job. litellm is imported lazily, with its cost map read
locally (never fetched).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from proxy.api.errors import APIError, ServerError
from proxy.api.protocol import ChatCompletionRequest
from proxy.redact import Redactor
from proxy.settings import UpstreamTarget

logger = logging.getLogger(__name__)

# Request fields that are rlproxy's own business or set here, never forwarded to the provider.
_NOT_FORWARDED = frozenset({"model", "messages", "stream", "stream_options", "metadata", "rlproxy"})


class UpstreamError(APIError):
    """An error of the provider (or of reaching it), with the status the client should see."""

    def __init__(self, message: str, status_code: int, type: str, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.status_code = status_code
        self.type = type


def _litellm() -> Any:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    litellm.suppress_debug_info = True
    return litellm


class UpstreamEngine:
    def __init__(
        self,
        targets: Mapping[str, UpstreamTarget],
        *,
        timeout_s: float = 600.0,
        redact: Callable[[str], str] | None = None,
    ) -> None:
        self.targets = dict(targets)
        self.timeout_s = timeout_s
        if redact is None:
            names = [t.api_key_env for t in self.targets.values() if t.api_key_env]
            redact = Redactor.from_environ(names)
        self.redact = redact

    def api_error(self, exc: Exception) -> APIError:
        """A provider's exception as the error the client sees, with no credential in it."""
        return to_api_error(exc, self.redact)

    def start(self) -> None:
        """Import litellm now (a few seconds) rather than on the first request."""
        _litellm()

    def serves(self, model: str) -> bool:
        return model in self.targets

    def model_ids(self) -> list[str]:
        return list(self.targets)

    async def acompletion(self, request: ChatCompletionRequest, *, stream: bool = False) -> Any:
        """The provider's answer: a response, or (streaming) an async iterator of chunks that
        always ends with a usage chunk. Raises the provider's exception (see `to_api_error`)."""
        kwargs = self._kwargs(request)
        if stream:
            kwargs.update(stream=True, stream_options={"include_usage": True})
        return await _litellm().acompletion(**kwargs)

    def _kwargs(self, request: ChatCompletionRequest) -> dict[str, Any]:
        target = self.targets[request.model]
        unknown = set(request.model_extra or {})
        body = request.model_dump(exclude_none=True, by_alias=True)
        kwargs = {k: v for k, v in body.items() if k not in _NOT_FORWARDED and k not in unknown}
        kwargs.update(
            model=target.model,
            messages=[m.model_dump(exclude_none=True) for m in request.messages],
            timeout=self.timeout_s,
            max_retries=0,  # the client retries; retrying here too would multiply its attempts
            num_retries=0,
        )
        if target.api_base:
            kwargs["api_base"] = target.api_base
        if target.api_key_env:
            key = os.environ.get(target.api_key_env)
            if not key:
                raise ServerError(
                    f"The upstream model `{request.model}` needs the provider key in the server's "
                    f"environment variable {target.api_key_env}, which is not set.",
                    code="upstream_not_configured",
                )
            kwargs["api_key"] = key
        return kwargs


def to_api_error(exc: Exception, redact: Callable[[str], str] | None = None) -> APIError:
    """A litellm/provider exception as the error the client sees; every text the provider wrote
    (message, type, param, code) passes through `redact` (default: the credential patterns of
    `proxy.redact`, without the server's own key values)."""
    if isinstance(exc, APIError):
        return exc
    if redact is None:
        redact = Redactor()
    import openai

    status = getattr(exc, "status_code", None)
    body = getattr(exc, "body", None)
    raw = body if isinstance(body, dict) else {}
    detail = {k: redact(v) if isinstance(v, str) else v for k, v in raw.items()}
    message = redact(str(detail.get("message") or getattr(exc, "message", None) or exc))
    if isinstance(exc, openai.APITimeoutError):
        return UpstreamError(
            f"The upstream provider timed out: {message}", 504, "server_error", code="timeout"
        )
    if isinstance(status, int) and 400 <= status < 500:
        kind = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}
        return UpstreamError(
            message,
            status,
            str(detail.get("type") or kind.get(status, "invalid_request_error")),
            param=detail.get("param"),
            code=str(detail["code"]) if detail.get("code") is not None else None,
        )
    unreachable = isinstance(exc, openai.APIConnectionError) or "Connection error" in message
    if unreachable:
        return UpstreamError(
            f"Could not reach the upstream provider: {message}",
            502,
            "server_error",
            code="upstream_unreachable",
        )
    return UpstreamError(
        f"The upstream provider failed: {message}",
        503 if status == 503 else 502,
        "server_error",
        code="upstream_error",
    )
