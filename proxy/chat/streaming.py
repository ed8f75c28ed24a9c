"""Streaming: OpenAI's chunk shapes and their server-sent-events framing, for every engine.

    chunks = Chunks(id=call.completion_id, model=req.model, created=call.created, usage=True)
    yield chunks.choice(0, {"role": "assistant", "content": ""})
    yield chunks.choice(0, {}, finish_reason="stop")
    yield chunks.usage(usage)
    ...
    StreamingResponse(sse(stream), media_type="text/event-stream", headers=SSE_HEADERS)

Both chat services (`service` for the local engine, `upstream` for other providers) build their
chunks here and the route frames them with `sse`: a `data: {json}` event per chunk, then
`data: [DONE]`. An error after the stream started is an `{"error": ...}` event before `[DONE]`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from proxy.chat.tool_parser import StreamParser, TextDelta, ToolCallArgsDelta, ToolCallStart
from proxy.protocols.chat import chunk

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
JSON_OR_SSE: dict[int | str, dict[str, object]] = {
    200: {
        "description": "The answer as JSON, or with `stream: true` as server-sent events.",
        "content": {"application/json": {}, "text/event-stream": {}},
    }
}
"""The OpenAPI `responses` of a route that answers with JSON or a stream."""


async def sse(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """Chunk dicts as server-sent events, then `[DONE]`."""
    async for item in chunks:
        yield f"data: {json.dumps(item, ensure_ascii=False, separators=(',', ':'))}\n\n"
    yield "data: [DONE]\n\n"


async def prepend(
    first: dict[str, Any] | None, rest: AsyncIterator[dict[str, Any]]
) -> AsyncIterator[dict[str, Any]]:
    """`first` (when there is one), then the rest: for a stream whose first chunk was awaited
    before the response started, so a failure before it could still be an HTTP error status."""
    if first is not None:
        yield first
    async for item in rest:
        yield item


def typed_sse(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """Typed events as server-sent events, `event: <its type>` then `data: <json>`, and no
    `[DONE]`: the Responses API's and Anthropic's framing (`proxy.protocols`)."""

    async def frames() -> AsyncIterator[str]:
        async for event in events:
            data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
            yield f"event: {event['type']}\ndata: {data}\n\n"

    return frames()


@dataclass(frozen=True)
class Chunks:
    """The chunks of one streamed response: every one has the same id, model and created."""

    id: str
    model: str
    created: int
    usage_field: bool = False
    """`stream_options.include_usage`: every chunk has a `usage` field (null until the last)."""

    def make(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return chunk(
            id=self.id,
            model=self.model,
            created=self.created,
            choices=choices,
            include_usage_field=self.usage_field,
        )

    def choice(
        self,
        index: int,
        delta: dict[str, Any],
        *,
        finish_reason: str | None = None,
        logprobs: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """A chunk with one choice's delta."""
        return self.make(
            [stream_choice(index, delta, finish_reason=finish_reason, logprobs=logprobs)]
        )

    def usage(self, usage: dict[str, Any]) -> dict[str, Any]:
        """The last chunk of a stream with `include_usage`: no choices, the usage."""
        return chunk(
            id=self.id,
            model=self.model,
            created=self.created,
            choices=[],
            usage_=usage,
            include_usage_field=True,
        )


def stream_choice(
    index: int,
    delta: dict[str, Any],
    *,
    finish_reason: str | None = None,
    logprobs: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    return {
        "index": index,
        "delta": delta,
        "logprobs": {"content": logprobs, "refusal": None} if logprobs else None,
        "finish_reason": finish_reason,
    }


def text_deltas(parser: StreamParser | None, text: str, *, final: bool) -> list[dict[str, Any]]:
    """OpenAI deltas for new output text: content, or a tool call's id and name once and then
    its argument fragments (when `parser` is given: the request has tools)."""
    if parser is None:
        return [{"content": text}] if text else []
    events = parser.feed(text) if text else []
    if final:
        events += parser.finish()
    deltas: list[dict[str, Any]] = []
    for ev in events:
        if isinstance(ev, TextDelta):
            if ev.text:
                deltas.append({"content": ev.text})
        elif isinstance(ev, ToolCallStart):
            call = {"name": ev.name, "arguments": ""}
            deltas.append(
                {
                    "tool_calls": [
                        {"index": ev.index, "id": ev.id, "type": "function", "function": call}
                    ]
                }
            )
        elif isinstance(ev, ToolCallArgsDelta) and ev.fragment:
            deltas.append(
                {"tool_calls": [{"index": ev.index, "function": {"arguments": ev.fragment}}]}
            )
    return deltas
