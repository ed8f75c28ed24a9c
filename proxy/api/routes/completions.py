"""`POST /v1/chat/completions`: JSON or server-sent events, OpenAI's exact framing.

A request whose model is an upstream name goes to the upstream chat service; every other
request to the local `ChatService`. Both produce the same JSON and chunk shapes, framed here by
the one SSE path (`proxy.chat.streaming.sse`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from proxy.api.auth import Caller, PermissionDeniedError, Principal
from proxy.api.body import TextJSONRoute
from proxy.api.deps import Generating, request_id
from proxy.api.http_metrics import label_model
from proxy.api.protocol import ChatCompletionRequest
from proxy.chat.record import CallInfo
from proxy.chat.streaming import SSE_HEADERS, prepend, sse
from proxy.chat.upstream import UpstreamChat
from storage.store import Store

router = APIRouter(route_class=TextJSONRoute)
T = TypeVar("T")


@router.post("/v1/chat/completions")
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, runtime: Generating, caller: Caller
):
    served = runtime.served
    assert served is not None  # `Generating` refuses a runtime without serving
    chat, upstream, adapters, store = served.chat, served.upstream, served.adapters, runtime.store
    label_model(request.scope, body.model)
    call = CallInfo(
        body,
        request_id(request),
        dict(request.headers),
        owner=caller.owner,
        client_ref=caller.client_ref,
    )
    await _check_trajectory_owner(call, caller, store)
    if upstream is not None and upstream.serves(body.model):
        return await _upstream(upstream, call)
    await adapters.ensure_servable(body.model)
    prepared = await chat.prepare(call)
    if not body.stream:
        body_ = await _unless_disconnected(request, chat.complete(prepared))
        if body_ is None:  # nobody is listening any more; the call is stored as disconnected
            return Response(status_code=499)
        return JSONResponse(body_)
    return StreamingResponse(
        sse(chat.stream(prepared)), media_type="text/event-stream", headers=SSE_HEADERS
    )


async def _check_trajectory_owner(call: CallInfo, caller: Principal, store: Store) -> None:
    """A key continues only its own trajectories: naming another key's is a 403 before any
    token is generated (admins included: their calls would be stored under their own key)."""
    tid = call.explicit_trajectory_id
    if tid is None or caller.key_id is None:
        return
    exists, owner = await store.trajectory_owner(tid)
    if exists and owner != caller.key_id:
        raise PermissionDeniedError(
            f"Trajectory '{tid}' belongs to another API key; this key cannot add turns to it.",
            param="trajectory_id",
        )


async def _unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T | None:
    """Run `work`; if the client goes away first, cancel it (its generation stops): None.

    If this request is cancelled itself (uvicorn's graceful shutdown ran out of time), `work` is
    cancelled and awaited before the cancellation goes on, so the call is stored as interrupted
    while the store is still open, not left running past the server's shutdown."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        raise
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


async def _upstream(upstream: UpstreamChat, call: CallInfo):
    if not call.request.stream:
        return JSONResponse(await upstream.complete(call))
    chunks = upstream.stream(call)
    # Wait for the provider's first chunk: a failure before it is still an HTTP error status.
    first = await anext(chunks, None)
    return StreamingResponse(
        sse(prepend(first, chunks)), media_type="text/event-stream", headers=SSE_HEADERS
    )
