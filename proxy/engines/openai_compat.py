"""The direct path to OpenAI-compatible servers: one pooled `aiohttp` session, no litellm.

    client = OpenAICompatClient(timeout_s=600, redact=redact)
    body = await client.complete(url, key, payload)             # the provider's JSON, a dict
    chunks = await client.stream(url, key, payload)             # opened: status already checked
    async for chunk in chunks: ...                               # each `data:` event, a dict

For an `openai/` upstream target litellm adds nothing rlproxy needs (the request is already
OpenAI's shape) but costs milliseconds per call (building its own request and response
objects, cost lookup). This client sends the request body as given and hands back what the
server sent: the JSON body, or each server-sent event's `data` parsed, in order, until
`data: [DONE]` or the end of the body (https://html.spec.whatwg.org/multipage/server-sent-events.html:
lines, `data:` fields joined by newlines, an empty line ends an event, `:` lines are comments).

Errors are `proxy.engines.upstream_errors.UpstreamError`s in OpenAI's shape, scrubbed of credentials
(`status_error`, shared with the litellm path): a provider's 4xx keeps its status, a provider's
5xx or broken body is a 502 (503 stays 503), an unreachable server a 502, a timeout a 504. An
error event inside a stream (`data: {"error": ...}`) ends the stream with that error.

One pooled aiohttp session (`proxy.engines.http_streams.PooledSession`, where the choice of
aiohttp is measured). Its pool hands a connection back only once a response was read to its end,
so streams are read on past `[DONE]` (`proxy.engines.http_streams.drain`).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp

from proxy.engines.http_streams import (
    TRANSPORT_ERRORS,
    PooledSession,
    drain,
    json_bytes,
    lines_of,
)
from proxy.engines.upstream_errors import UpstreamError, status_error

DONE = "[DONE]"
USER_AGENT = "rlproxy"
"""What the direct path tells providers it is (litellm's path sends the openai SDK's)."""


class OpenAICompatClient:
    def __init__(self, *, timeout_s: float, redact: Callable[[str], str]) -> None:
        self.redact = redact
        # As httpx's timeout did: `timeout_s` for connecting (at most 10 s) and for each read,
        # no bound on a whole answer (a long stream that keeps sending is fine).
        timeout = aiohttp.ClientTimeout(
            total=None, connect=min(timeout_s, 10.0), sock_read=timeout_s
        )
        self._http = PooledSession(timeout, limit=1000)

    async def aclose(self) -> None:
        await self._http.close()

    async def complete(self, url: str, key: str | None, payload: dict[str, Any]) -> dict[str, Any]:
        """POST `payload`; the JSON body of a 2xx answer, else the provider's error raised."""
        try:
            async with self._http().post(
                url, data=json_bytes(payload), headers=_headers(key)
            ) as response:
                status, content = response.status, await response.read()
        except TRANSPORT_ERRORS as exc:
            raise self._transport_error(exc) from exc
        if status >= 400:
            raise self._status_error(status, content)
        try:
            body = json.loads(content)
        except ValueError as exc:
            raise self._bad_body("a body that is not JSON") from exc
        if not isinstance(body, dict) or not isinstance(body.get("choices"), list):
            if isinstance(body, dict) and body.get("error") is not None:
                raise self._status_error(502, content)
            raise self._bad_body("a body without `choices`")
        return body

    async def stream(
        self, url: str, key: str | None, payload: dict[str, Any]
    ) -> AsyncIterator[dict[str, Any]]:
        """POST a streamed `payload`; return its events once the answer's status is known (a
        refusal is raised here, before any chunk)."""
        try:
            response = await self._http().post(
                url, data=json_bytes(payload), headers=_headers(key, sse=True)
            )
        except TRANSPORT_ERRORS as exc:
            raise self._transport_error(exc) from exc
        if response.status >= 400:
            try:
                content = await response.read()
            except TRANSPORT_ERRORS:
                content = b""
            finally:
                response.release()
            raise self._status_error(response.status, content)
        return self._events(response)

    async def _events(self, response: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
        data: list[str] = []
        lines = lines_of(response.content.iter_any())
        try:
            async for line in lines:
                if line:
                    if line.startswith("data:"):
                        value = line[5:]
                        data.append(value[1:] if value.startswith(" ") else value)
                    continue  # comments, `event:`, `id:`, `retry:`: nothing rlproxy uses
                if not data:
                    continue
                text = "\n".join(data)
                data = []
                if text == DONE:
                    await drain(lines)  # the connection goes back to the pool
                    return
                yield self._event(text)
            if data and "\n".join(data) != DONE:  # a last event without its empty line
                yield self._event("\n".join(data))
        except TRANSPORT_ERRORS as exc:
            raise self._transport_error(exc) from exc
        finally:
            # Read to its end: pooled again; cut short (an error, a client gone): closed.
            response.release()

    def _event(self, text: str) -> dict[str, Any]:
        try:
            event = json.loads(text)
        except ValueError as exc:
            raise self._bad_body("a stream event that is not JSON") from exc
        if not isinstance(event, dict):
            raise self._bad_body("a stream event that is not a JSON object")
        if event.get("error") is not None:
            raise self._status_error(502, text.encode())
        return event

    def _status_error(self, status: int, content: bytes) -> UpstreamError:
        try:
            parsed = json.loads(content) if content else None
        except ValueError:
            parsed = None
        error = parsed.get("error") if isinstance(parsed, dict) else None
        if isinstance(error, dict):
            detail = error
        elif isinstance(error, str):
            detail = {"message": error}
        else:
            text = content.decode("utf-8", "replace").strip()[:2000]
            detail = {"message": text or f"HTTP {status}"}
        return status_error(status, detail, self.redact)

    def _transport_error(self, exc: BaseException) -> UpstreamError:
        message = self.redact(str(exc) or type(exc).__name__)
        if isinstance(exc, TimeoutError):  # aiohttp's connect and read timeouts are both
            return UpstreamError(
                f"The upstream provider timed out: {message}", 504, "server_error", code="timeout"
            )
        if isinstance(exc, aiohttp.ClientConnectorError):
            return UpstreamError(
                f"Could not reach the upstream provider: {message}",
                502,
                "server_error",
                code="upstream_unreachable",
            )
        return UpstreamError(
            f"The upstream provider failed: {message}", 502, "server_error", code="upstream_error"
        )

    def _bad_body(self, what: str) -> UpstreamError:
        return UpstreamError(
            f"The upstream provider answered with {what}.",
            502,
            "server_error",
            code="upstream_error",
        )


def _headers(key: str | None, *, sse: bool = False) -> dict[str, str]:
    headers = {
        "user-agent": USER_AGENT,
        "content-type": "application/json",
        "accept": "text/event-stream" if sse else "application/json",
    }
    if key:
        headers["authorization"] = f"Bearer {key}"
    return headers
