"""The `upstream` engine: chat calls for configured model names forwarded through litellm.

    engine = UpstreamEngine(settings.upstream_models, sink=store.record_call)
    body = await engine.complete(request, request_id, headers)          # OpenAI JSON
    async for chunk in engine.stream(request, request_id, headers): ...  # OpenAI chunks

Each served name maps to a litellm target (`provider/model`, an optional `api_base`, and the name
of the server's environment variable holding the provider key: the key never comes from the
request). Responses are re-framed exactly like the local engine's (same ids, chunks, optional
usage chunk); provider errors become OpenAI-shaped errors (a provider 4xx keeps its status,
an unreachable provider is a 502, a timeout a 504). Every call, errors included, is stored
through the sink before it is acknowledged, as a `CallRecord` with engine "upstream" and no
token ids (providers return none; the row says so).

This module does not generate tokens, link trajectories or speak HTTP to clients; it cannot be
trained on. litellm is imported lazily, with its cost map read locally (never fetched).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

from proxy.errors import APIError, ServerError
from proxy.protocol import ChatCompletionRequest, assistant_message, chunk, completion_body, now
from proxy.protocol import completion_id as make_completion_id
from proxy.recording import RETRY_HEADER, api_key_id, explicit_id
from proxy.settings import UpstreamTarget
from storage.records import CallRecord, ChoiceRecord

logger = logging.getLogger(__name__)

NO_TOKEN_IDS = "provider returned no token ids"
# Request fields that are rlproxy's own business or set here, never forwarded to the provider.
_NOT_FORWARDED = frozenset({"model", "messages", "stream", "stream_options", "metadata", "rlproxy"})

RecordSink = Callable[[CallRecord], Awaitable[object]]


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
        sink: RecordSink | None = None,
        *,
        timeout_s: float = 600.0,
    ) -> None:
        self.targets = dict(targets)
        self.sink = sink
        self.timeout_s = timeout_s

    def start(self) -> None:
        """Import litellm now (a few seconds) rather than on the first request."""
        _litellm()

    def serves(self, model: str) -> bool:
        return model in self.targets

    def model_ids(self) -> list[str]:
        return list(self.targets)

    # ----------------------------------------------------------------- calls

    async def complete(
        self, request: ChatCompletionRequest, request_id: str, headers: Mapping[str, str]
    ) -> dict[str, Any]:
        call = _Call(request, request_id, headers)
        try:
            response = await _litellm().acompletion(**self._kwargs(request))
        except asyncio.CancelledError:
            await asyncio.shield(self._record(call, "client_disconnected", [], None, None))
            raise
        except Exception as exc:
            error = to_api_error(exc)
            await self._record(call, "error", [], None, None, error.message)
            raise error from exc
        raw = response.model_dump()
        choices = [_choice(c) for c in raw.get("choices") or []]
        body = completion_body(
            id=make_completion_id(request_id),
            model=request.model,
            created=now(),
            choices=choices,
            usage_=_clean(raw.get("usage")),
        )
        records = [ChoiceRecord(c["index"], c["message"], c["finish_reason"]) for c in choices]
        await self._record(call, "completed", records, body, body["usage"])
        return body

    async def stream(
        self, request: ChatCompletionRequest, request_id: str, headers: Mapping[str, str]
    ) -> AsyncIterator[dict[str, Any]]:
        """OpenAI chunk dicts as the provider sends them; an `{"error": ...}` dict last on a
        failure after the first chunk. A failure before any chunk raises (callers that peek the
        first item can still answer with an HTTP error status)."""
        call = _Call(request, request_id, headers)
        wants_usage = bool(request.stream_options and request.stream_options.include_usage)
        try:
            response = await _litellm().acompletion(
                **self._kwargs(request), stream=True, stream_options={"include_usage": True}
            )
        except Exception as exc:
            error = to_api_error(exc)
            await self._record(call, "error", [], None, None, error.message)
            raise error from exc
        acc = StreamAccumulator()
        status, sent = "client_disconnected", False

        def frame(choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> dict:
            return chunk(
                id=make_completion_id(request_id),
                model=request.model,
                created=call.created,
                choices=choices,
                usage_=usage,
                include_usage_field=wants_usage,
            )

        try:
            async for raw in response:
                choices, usage = acc.add(raw.model_dump())
                if choices:
                    sent = True
                    yield frame(choices)
                if usage is not None and wants_usage:
                    sent = True
                    yield frame([], usage)
            status = "completed"
            await self._record(call, status, acc.choices(), acc.body(frame), acc.usage)
        except Exception as exc:
            status = "error"
            error = to_api_error(exc)
            await self._record(call, status, acc.choices(), None, acc.usage, error.message)
            if not sent:
                raise error from exc
            yield error.body()
        finally:
            if status == "client_disconnected":
                await asyncio.shield(self._record(call, status, acc.choices(), None, acc.usage))

    # ----------------------------------------------------------------- helpers

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

    async def _record(
        self,
        call: _Call,
        status: str,
        choices: list[ChoiceRecord],
        body: dict[str, Any] | None,
        usage: dict[str, Any] | None,
        error: str | None = None,
    ) -> None:
        if self.sink is not None:
            await self.sink(call.record(status, choices, body, usage, error))


class _Call:
    """What is known about a call when it starts; `record()` completes it into a CallRecord."""

    def __init__(
        self, request: ChatCompletionRequest, request_id: str, headers: Mapping[str, str]
    ) -> None:
        self.request = request
        self.request_id = request_id
        self.headers = {k.lower(): v for k, v in headers.items()}
        self.started = time.time()
        self.created = int(self.started)

    def record(
        self,
        status: str,
        choices: list[ChoiceRecord],
        body: dict[str, Any] | None,
        usage: dict[str, Any] | None,
        error: str | None,
    ) -> CallRecord:
        req, headers = self.request, self.headers
        finished = time.time()
        params = req.model_dump(exclude_none=True, by_alias=True)
        for key in ("messages", "tools", "model"):
            params.pop(key, None)
        return CallRecord(
            id=uuid.uuid4().hex,
            request_id=self.request_id,
            completion_id=make_completion_id(self.request_id),
            created_at=self.started,
            finished_at=finished,
            model_requested=req.model,
            engine="upstream",
            request_messages=[m.model_dump(exclude_none=True) for m in req.messages],
            tools=[t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None,
            params=params,
            response=body,
            choices=choices,
            usage=usage,
            latency_s=finished - self.started,
            status=status,  # type: ignore[arg-type]
            error=error,
            api_key_id=api_key_id(headers.get("authorization")),
            stream=bool(req.stream),
            token_ids_note=NO_TOKEN_IDS,
            explicit_trajectory_id=explicit_id(headers, req.metadata, req.rlproxy, "trajectory"),
            explicit_group_key=explicit_id(headers, req.metadata, req.rlproxy, "group"),
            retry_count=_retry_count(headers.get(RETRY_HEADER)),
        )


class StreamAccumulator:
    """Cleans litellm's chunks into OpenAI's delta shape and assembles the final messages."""

    def __init__(self) -> None:
        self._text: dict[int, list[str]] = {}
        self._calls: dict[int, dict[int, dict[str, Any]]] = {}
        self._finish: dict[int, str | None] = {}
        self.usage: dict[str, Any] | None = None

    def add(self, raw: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
        """One provider chunk -> (choices to send, usage if this chunk carried it)."""
        out = []
        for c in raw.get("choices") or []:
            i = c.get("index", 0)
            self._text.setdefault(i, [])
            delta = _clean_delta(c.get("delta") or {})
            if delta.get("content"):
                self._text[i].append(delta["content"])
            for tc in delta.get("tool_calls", []):
                slot = self._calls.setdefault(i, {}).setdefault(
                    tc.get("index", 0),
                    {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
                )
                slot["id"] = tc.get("id") or slot["id"]
                fn = tc.get("function") or {}
                slot["function"]["name"] += fn.get("name") or ""
                slot["function"]["arguments"] += fn.get("arguments") or ""
            if c.get("finish_reason"):
                self._finish[i] = c["finish_reason"]
            if delta or c.get("finish_reason") or c.get("logprobs"):
                out.append(
                    {
                        "index": i,
                        "delta": delta,
                        "logprobs": c.get("logprobs"),
                        "finish_reason": c.get("finish_reason"),
                    }
                )
        usage = _clean(raw.get("usage")) if raw.get("usage") else None
        if usage is not None:
            self.usage = usage
        return out, usage

    def messages(self) -> dict[int, dict[str, Any]]:
        out = {}
        for i, parts in sorted(self._text.items()):
            calls = [c for _, c in sorted(self._calls.get(i, {}).items())]
            text = "".join(parts)
            out[i] = assistant_message(text if text or not calls else None, calls)
        return out

    def choices(self) -> list[ChoiceRecord]:
        return [ChoiceRecord(i, m, self._finish.get(i)) for i, m in self.messages().items()]

    def body(self, frame: Callable[..., dict[str, Any]]) -> dict[str, Any]:
        """The response as one `chat.completion` body, for storage."""
        head = frame([])
        choices = [
            {"index": i, "message": m, "logprobs": None, "finish_reason": self._finish.get(i)}
            for i, m in self.messages().items()
        ]
        return completion_body(
            id=head["id"],
            model=head["model"],
            created=head["created"],
            choices=choices,
            usage_=self.usage or {},
        )


def _clean_delta(delta: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in ("role", "content", "refusal"):
        if delta.get(key) is not None:
            out[key] = delta[key]
    if delta.get("tool_calls"):
        calls = []
        for tc in delta["tool_calls"]:
            fn = {k: v for k, v in (tc.get("function") or {}).items() if v is not None}
            item: dict[str, Any] = {"index": tc.get("index", 0)}
            if tc.get("id"):
                item.update(id=tc["id"], type=tc.get("type") or "function")
            item["function"] = fn
            calls.append(item)
        out["tool_calls"] = calls
    return out


def _choice(raw: dict[str, Any]) -> dict[str, Any]:
    msg = raw.get("message") or {}
    calls = [
        {
            "id": tc.get("id"),
            "type": tc.get("type") or "function",
            "function": {
                "name": (tc.get("function") or {}).get("name"),
                "arguments": (tc.get("function") or {}).get("arguments") or "",
            },
        }
        for tc in msg.get("tool_calls") or []
    ]
    message = assistant_message(msg.get("content"), calls)
    if msg.get("refusal"):
        message["refusal"] = msg["refusal"]
    return {
        "index": raw.get("index", 0),
        "message": message,
        "logprobs": raw.get("logprobs"),
        "finish_reason": raw.get("finish_reason"),
    }


def _clean(value: Any) -> Any:
    """Drop the None fields litellm adds (recursively); OpenAI omits them."""
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items() if v is not None}
    return value


def _retry_count(value: str | None) -> int:
    try:
        return max(0, int(value)) if value else 0
    except ValueError:
        return 0


def to_api_error(exc: Exception) -> APIError:
    """A litellm/provider exception as the error the client sees."""
    if isinstance(exc, APIError):
        return exc
    import openai

    status = getattr(exc, "status_code", None)
    body = getattr(exc, "body", None)
    detail = body if isinstance(body, dict) else {}
    message = str(detail.get("message") or getattr(exc, "message", None) or exc)
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
