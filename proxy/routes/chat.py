"""`POST /v1/chat/completions`: JSON or server-sent events, OpenAI's exact framing."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from proxy.chat import PreparedChat
from proxy.protocol import ChatCompletionRequest
from proxy.routes.deps import Chat, request_id

router = APIRouter()


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request, chat: Chat):
    prepared = chat.prepare(body, request_id(request), headers=dict(request.headers))
    if not body.stream:
        return JSONResponse(await chat.complete(prepared))
    return StreamingResponse(
        _sse(chat.stream(prepared), prepared),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _sse(chunks: AsyncIterator[dict[str, Any]], prepared: PreparedChat):
    async for item in chunks:
        yield f"data: {json.dumps(item, ensure_ascii=False, separators=(',', ':'))}\n\n"
    yield "data: [DONE]\n\n"
