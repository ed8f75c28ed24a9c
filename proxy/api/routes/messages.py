"""Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

The request is translated into the core's chat request (`proxy.protocols.messages`), answered by
`proxy.api.serving.serve` like any chat call, and the answer translated back: a `message`, or
Anthropic's event stream. Keys may come as `x-api-key` (what Anthropic's SDKs send) or as
`Authorization: Bearer`; errors on these paths are Anthropic's shape (`proxy.api.app`). Fields
with no effect here (`thinking`, `output_config.effort`, ...) are named in
`X-RLProxy-Ignored-Fields` (`proxy.protocols.messages.ignored_fields`).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from proxy.api.auth import Caller
from proxy.api.body import TextJSONRoute
from proxy.api.deps import Chat, Generating, request_id
from proxy.api.serving import serve
from proxy.chat.record import CallInfo
from proxy.chat.streaming import JSON_OR_SSE, SSE_HEADERS, typed_sse
from proxy.errors import ContextLengthError
from proxy.protocols import messages
from proxy.protocols.messages import CountTokensRequest, MessagesRequest

router = APIRouter(route_class=TextJSONRoute)


@router.post("/v1/messages", responses=JSON_OR_SSE)
async def create_message(
    body: MessagesRequest, request: Request, runtime: Generating, caller: Caller
):
    chat = messages.to_chat(body, stream=bool(body.stream))
    call = CallInfo(
        chat,
        request_id(request),
        dict(request.headers),
        owner=caller.owner,
        client_ref=caller.client_ref,
        protocol="messages",
        ignored=messages.ignored_fields(body),
    )
    try:
        answer = await serve(request, runtime, caller, call)
    except ContextLengthError as exc:
        raise messages.context_error(exc) from exc
    shortened = answer.budget is not None and answer.budget.shortened
    if answer.chunks is not None:
        events = messages.Events(
            call.completion_id,
            answer.model,
            answer.prompt_tokens or 0,
            lambda: call.stopped_by.get(0),
            shortened,
        )
        return StreamingResponse(
            typed_sse(events.run(answer.chunks)),
            media_type="text/event-stream",
            headers={**SSE_HEADERS, **answer.headers},
        )
    if answer.body is None:  # nobody is listening any more; the call is stored as disconnected
        return Response(status_code=499)
    message = messages.render(
        call.completion_id, answer.model, answer.body, call.stopped_by.get(0), shortened
    )
    return JSONResponse(message, headers=answer.headers)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request, chat: Chat) -> dict[str, Any]:
    """The prompt's length in the policy's tokens, rendered as it would be served (an upstream
    model's own count may differ), whatever its length: one longer than the context is counted."""
    call = CallInfo(messages.to_chat(body), request_id(request), protocol="messages")
    return {"input_tokens": await chat.count_prompt_tokens(call)}
