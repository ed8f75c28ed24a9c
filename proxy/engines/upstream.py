"""The `upstream` engine: the model names served by other providers.

    engine = UpstreamEngine(settings.upstream_models, timeout_s=600)
    body = await engine.complete(request)                 # the provider's response, a dict
    chunks = await engine.stream(request)                 # opened; async iterator of chunk dicts

Each served name maps to a target (`provider/model`, an optional `api_base`, and the name of the
server's environment variable holding the provider key: the key never comes from the request).
An `openai/` target (OpenAI itself or any OpenAI-compatible server) is called directly
(`proxy.engines.openai_compat`: one pooled aiohttp session, the request body as OpenAI's, chunks
as the server sends them); every other provider, or a target with `via: litellm`, goes through
litellm, which exists to translate those protocols. Both paths hand back plain OpenAI dicts.

Provider failures become OpenAI-shaped errors (`UpstreamError`; `to_api_error` for litellm's
exceptions, `proxy.engines.upstream_errors.status_error` for a provider's status and error
body): a provider 4xx keeps its status, an unreachable provider is a 502, a timeout a 504,
scrubbed of credentials first (`proxy.redact`): a provider that echoes the key it was sent must
not hand the server's key to a client, the database or a log.

Unlike the token-level engines (`base.Engine`), this one speaks messages: providers return no
token ids, so its calls are stored but cannot be trained on. Re-framing responses and recording
calls is `proxy.chat.upstream`'s job. litellm is imported lazily, with its cost map read
locally (never fetched), and only when a target needs it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator, Callable, Mapping
from typing import TYPE_CHECKING, Any, cast

from proxy.engines.upstream_errors import UpstreamError, status_error
from proxy.errors import APIError, ServerError
from proxy.protocols.chat import ChatCompletionRequest
from proxy.redact import Redactor
from proxy.settings import UpstreamTarget

if TYPE_CHECKING:
    from proxy.engines.openai_compat import OpenAICompatClient

logger = logging.getLogger(__name__)

# Request fields that are rlproxy's own business or set here, never forwarded to the provider
# (`prompt_cache_key` keys rlproxy's own replica routing; litellm refuses it for most providers).
_NOT_FORWARDED = {
    "model",
    "messages",
    "stream",
    "stream_options",
    "metadata",
    "rlproxy",
    "prompt_cache_key",
}


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
        self._direct: OpenAICompatClient | None = None

    def api_error(self, exc: Exception) -> APIError:
        """A provider's exception as the error the client sees, with no credential in it."""
        return to_api_error(exc, self.redact)

    def start(self) -> None:
        """Import litellm now (a few seconds) rather than on the first request, if a target
        needs it."""
        if not all(is_direct(t) for t in self.targets.values()):
            _litellm()

    async def aclose(self) -> None:
        if self._direct is not None:
            await self._direct.aclose()

    def serves(self, model: str) -> bool:
        return model in self.targets

    def model_ids(self) -> list[str]:
        return list(self.targets)

    async def complete(self, request: ChatCompletionRequest) -> dict[str, Any]:
        """The provider's `chat.completion` as a dict. Raises `APIError` (direct path) or the
        provider's exception (litellm; see `to_api_error`)."""
        target = self.targets[request.model]
        if is_direct(target):
            url, key, payload = self._direct_call(request, target)
            return await self._client().complete(url, key, payload)
        response = await _litellm().acompletion(**self._kwargs(request))
        return cast(dict[str, Any], response.model_dump())

    async def stream(self, request: ChatCompletionRequest) -> AsyncIterator[dict[str, Any]]:
        """The provider's chunks as dicts, opened (a refusal before the first chunk is raised
        here); the last one carries the usage when the provider reports it."""
        target = self.targets[request.model]
        if is_direct(target):
            url, key, payload = self._direct_call(request, target)
            payload.update(stream=True, stream_options={"include_usage": True})
            return await self._client().stream(url, key, payload)
        kwargs = self._kwargs(request)
        kwargs.update(stream=True, stream_options={"include_usage": True})
        response = await _litellm().acompletion(**kwargs)
        return _dumped(response)

    def _client(self) -> OpenAICompatClient:
        if self._direct is None:
            from proxy.engines.openai_compat import OpenAICompatClient

            self._direct = OpenAICompatClient(timeout_s=self.timeout_s, redact=self.redact)
        return self._direct

    def _direct_call(
        self, request: ChatCompletionRequest, target: UpstreamTarget
    ) -> tuple[str, str | None, dict[str, Any]]:
        """URL, key and JSON body of a direct call: the request's OpenAI fields as the client
        sent them, with the provider's model name."""
        payload = _forwarded(request)
        payload["model"] = target.model.split("/", 1)[1]
        base = target.api_base or os.environ.get("OPENAI_BASE_URL") or OPENAI_BASE
        key = self._key(request, target) or (
            None if target.api_key_env else os.environ.get("OPENAI_API_KEY")
        )
        return f"{base.rstrip('/')}/chat/completions", key, payload

    def _kwargs(self, request: ChatCompletionRequest) -> dict[str, Any]:
        """litellm's keyword arguments for `request`."""
        target = self.targets[request.model]
        kwargs = _forwarded(request)
        kwargs.update(
            model=target.model,
            timeout=self.timeout_s,
            max_retries=0,  # the client retries; retrying here too would multiply its attempts
            num_retries=0,
        )
        if target.api_base:
            kwargs["api_base"] = target.api_base
        key = self._key(request, target)
        if key:
            kwargs["api_key"] = key
        return kwargs

    def _key(self, request: ChatCompletionRequest, target: UpstreamTarget) -> str | None:
        """The provider key from the server's environment (None: the provider's default)."""
        if not target.api_key_env:
            return None
        key = os.environ.get(target.api_key_env)
        if not key:
            raise ServerError(
                f"The upstream model `{request.model}` needs the provider key in the server's "
                f"environment variable {target.api_key_env}, which is not set.",
                code="upstream_not_configured",
            )
        return key


OPENAI_BASE = "https://api.openai.com/v1"


def is_direct(target: UpstreamTarget) -> bool:
    """Whether `target` is called over the direct OpenAI-compatible path (not litellm)."""
    return target.via == "auto" and target.model.startswith("openai/")


def _forwarded(request: ChatCompletionRequest) -> dict[str, Any]:
    """The request's OpenAI fields as the client sent them (aliases, no nulls), without
    rlproxy's own fields and the top-level fields rlproxy does not know."""
    unknown = set(request.model_extra or {})
    body = request.model_dump(exclude_none=True, by_alias=True, exclude=_NOT_FORWARDED | unknown)
    body["messages"] = [m.model_dump(exclude_none=True) for m in request.messages]
    return body


async def _dumped(chunks: Any) -> AsyncIterator[dict[str, Any]]:
    async for chunk in chunks:
        yield chunk.model_dump()


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
    detail = dict(body) if isinstance(body, dict) else {}
    detail["message"] = detail.get("message") or getattr(exc, "message", None) or str(exc)
    if isinstance(exc, openai.APITimeoutError):
        message = redact(str(detail["message"]))
        return UpstreamError(
            f"The upstream provider timed out: {message}", 504, "server_error", code="timeout"
        )
    if not (isinstance(status, int) and 400 <= status < 500) and (
        isinstance(exc, openai.APIConnectionError) or "Connection error" in str(detail["message"])
    ):
        message = redact(str(detail["message"]))
        return UpstreamError(
            f"Could not reach the upstream provider: {message}",
            502,
            "server_error",
            code="upstream_unreachable",
        )
    return status_error(status if isinstance(status, int) else 502, detail, redact)
