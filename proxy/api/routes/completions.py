"""`POST /v1/chat/completions`: JSON or server-sent events, OpenAI's exact framing.

The request is already the core's shape; `proxy.api.serving.serve` answers it (upstream names
to the upstream service, every other name to the policy) and the route frames what comes back:
the body as JSON, chunks through the one SSE path (`proxy.chat.streaming.sse`). Fields OpenAI
takes that have no effect here (`store: false`, unknown ones, ...) are named in
`X-RLProxy-Ignored-Fields` (`proxy.protocols.chat.ignored_fields`).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from proxy.api.auth import Caller
from proxy.api.body import TextJSONRoute
from proxy.api.deps import Generating, request_id
from proxy.api.serving import serve
from proxy.chat.record import CallInfo
from proxy.chat.streaming import JSON_OR_SSE, SSE_HEADERS, sse
from proxy.protocols.chat import ChatCompletionRequest, ignored_fields

router = APIRouter(route_class=TextJSONRoute)


@router.post("/v1/chat/completions", responses=JSON_OR_SSE)
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, runtime: Generating, caller: Caller
):
    call = CallInfo(
        body,
        request_id(request),
        dict(request.headers),
        owner=caller.owner,
        client_ref=caller.client_ref,
        ignored=ignored_fields(body),
    )
    answer = await serve(request, runtime, caller, call)
    if answer.chunks is not None:
        return StreamingResponse(
            sse(answer.chunks),
            media_type="text/event-stream",
            headers={**SSE_HEADERS, **answer.headers},
        )
    if answer.body is None:  # nobody is listening any more; the call is stored as disconnected
        return Response(status_code=499)
    return JSONResponse(answer.body, headers=answer.headers)
