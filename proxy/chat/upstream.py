"""The upstream chat service: calls for upstream model names, through `proxy.engines.upstream`.

    chat = UpstreamChat(engine, record=store.record_call)
    body = await chat.complete(call)                   # OpenAI JSON
    async for chunk in chat.stream(call): ...          # OpenAI chunks (`proxy.chat.streaming`)

Responses are re-framed exactly like the local engine's (same ids, chunks, optional usage
chunk). Every call, errors included, is recorded (`proxy.chat.record.call_record`) before it is
acknowledged, with engine "upstream" and no token ids (providers return none; the row says so).

A Messages or Responses call's `reasoning_content` (an Anthropic thinking block's text, a
reasoning item's, read by the protocol's edge) is stored with the call and not sent: the chat
wire has no standard field for it, and the provider's own form of it (a signature, encrypted
content) is gone. A Chat Completions client's own `reasoning_content` is forwarded as sent.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from proxy.chat.record import CallInfo, call_record
from proxy.chat.service import RecordSink
from proxy.chat.streaming import Chunks
from proxy.engines.upstream import UpstreamEngine
from proxy.protocols.chat import ChatCompletionRequest, assistant_message, completion_body
from storage.records import CallStatus, ChoiceRecord

logger = logging.getLogger(__name__)

NO_TOKEN_IDS = "provider returned no token ids"


class UpstreamChat:
    def __init__(self, engine: UpstreamEngine, record: RecordSink | None = None) -> None:
        self.engine = engine
        self.record = record

    def serves(self, model: str) -> bool:
        return self.engine.serves(model)

    def model_ids(self) -> list[str]:
        return self.engine.model_ids()

    async def complete(self, call: CallInfo) -> dict[str, Any]:
        request = call.request
        try:
            raw = await self.engine.complete(for_provider(call))
        except asyncio.CancelledError:
            await asyncio.shield(self._record(call, "client_disconnected", [], None, None))
            raise
        except Exception as exc:
            error = self.engine.api_error(exc)
            await self._record(call, "error", [], None, None, error.message)
            raise error from exc
        choices = [_choice(c) for c in raw.get("choices") or []]
        body = completion_body(
            id=call.completion_id,
            model=request.model,
            created=call.created,
            choices=choices,
            usage_=_clean(raw.get("usage")),
        )
        records = [ChoiceRecord(c["index"], c["message"], c["finish_reason"]) for c in choices]
        await self._record(call, "completed", records, body, body["usage"])
        return body

    async def stream(self, call: CallInfo) -> AsyncIterator[dict[str, Any]]:
        """OpenAI chunk dicts as the provider sends them; an `{"error": ...}` dict last on a
        failure after the first chunk. A failure before any chunk raises (callers that peek the
        first item can still answer with an HTTP error status)."""
        request = call.request
        wants_usage = bool(request.stream_options and request.stream_options.include_usage)
        try:
            response = await self.engine.stream(for_provider(call))
        except Exception as exc:
            error = self.engine.api_error(exc)
            await self._record(call, "error", [], None, None, error.message)
            raise error from exc
        acc = StreamAccumulator()
        chunks = Chunks(call.completion_id, request.model, call.created, wants_usage)
        status: CallStatus = "client_disconnected"
        sent = False
        try:
            async for raw in response:
                choices, usage = acc.add(raw)
                if choices:
                    call.token_arrived()
                    sent = True
                    yield chunks.make(choices)
                if usage is not None and wants_usage:
                    sent = True
                    yield chunks.usage(usage)
            status = "completed"
            await self._record(call, status, acc.choices(), acc.body(chunks), acc.usage)
        except Exception as exc:
            status = "error"
            error = self.engine.api_error(exc)
            await self._record(call, status, acc.choices(), None, acc.usage, error.message)
            if not sent:
                raise error from exc
            yield error.body()
        finally:
            closing = getattr(response, "aclose", None)
            if closing is not None:  # the provider's connection goes back to the pool now
                await closing()
            if status == "client_disconnected":
                await asyncio.shield(self._record(call, status, acc.choices(), None, acc.usage))

    async def _record(
        self,
        call: CallInfo,
        status: CallStatus,
        choices: list[ChoiceRecord],
        body: dict[str, Any] | None,
        usage: dict[str, Any] | None,
        error: str | None = None,
    ) -> None:
        if self.record is None:
            return
        record = call_record(
            call,
            engine="upstream",
            status=status,
            choices=choices,
            response=body,
            usage=usage,
            error=error,
            token_ids_note=NO_TOKEN_IDS,
        )
        await self.record(record)


def for_provider(call: CallInfo) -> ChatCompletionRequest:
    """The request as the provider gets it: a translated call's reasoning text left out (see
    the module docstring)."""
    request = call.request
    if call.protocol == "chat" or not any(m.reasoning_content for m in request.messages):
        return request
    messages = [m.model_copy(update={"reasoning_content": None}) for m in request.messages]
    return request.model_copy(update={"messages": messages})


class StreamAccumulator:
    """Cleans provider chunks into OpenAI's delta shape (litellm's carry null fields OpenAI
    omits) and assembles the final messages."""

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

    def body(self, chunks: Chunks) -> dict[str, Any]:
        """The response as one `chat.completion` body, for storage."""
        choices = [
            {"index": i, "message": m, "logprobs": None, "finish_reason": self._finish.get(i)}
            for i, m in self.messages().items()
        ]
        return completion_body(
            id=chunks.id,
            model=chunks.model,
            created=chunks.created,
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
