"""`POST /v1/chat/completions`: JSON or server-sent events, OpenAI's exact framing.

A request whose model is an upstream name (`app.state.upstream`) goes to the upstream engine;
every other request to the local `ChatService`. Both produce the same JSON and chunk shapes.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from proxy.protocol import ChatCompletionRequest
from proxy.routes.deps import Chat, request_id
from proxy.upstream import UpstreamEngine

router = APIRouter()
T = TypeVar("T")

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request, chat: Chat):
    upstream: UpstreamEngine | None = getattr(request.app.state, "upstream", None)
    if upstream is not None and upstream.serves(body.model):
        return await _upstream(upstream, body, request)
    prepared = chat.prepare(body, request_id(request), headers=dict(request.headers))
    if not body.stream:
        body_ = await _unless_disconnected(request, chat.complete(prepared))
        if body_ is None:  # nobody is listening any more; the call is stored as disconnected
            return Response(status_code=499)
        return JSONResponse(body_)
    return StreamingResponse(
        _sse(chat.stream(prepared)), media_type="text/event-stream", headers=_SSE_HEADERS
    )


async def _unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T | None:
    """Run `work`; if the client goes away first, cancel it (its generation stops): None."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return None
    return task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _upstream(upstream: UpstreamEngine, body: ChatCompletionRequest, request: Request):
    rid, headers = request_id(request), dict(request.headers)
    if not body.stream:
        return JSONResponse(await upstream.complete(body, rid, headers))
    chunks = upstream.stream(body, rid, headers)
    # Wait for the provider's first chunk: a failure before it is still an HTTP error status.
    first = await anext(chunks, None)
    return StreamingResponse(
        _sse(_prepend(first, chunks)), media_type="text/event-stream", headers=_SSE_HEADERS
    )


async def _prepend(
    first: dict[str, Any] | None, rest: AsyncIterator[dict[str, Any]]
) -> AsyncIterator[dict[str, Any]]:
    if first is not None:
        yield first
    async for item in rest:
        yield item


async def _sse(chunks: AsyncIterator[dict[str, Any]]):
    async for item in chunks:
        yield f"data: {json.dumps(item, ensure_ascii=False, separators=(',', ':'))}\n\n"
    yield "data: [DONE]\n\n"
