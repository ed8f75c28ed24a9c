"""OpenAI's Responses API: `POST /v1/responses`, `GET`/`DELETE /v1/responses/{id}`,
`GET /v1/responses/{id}/input_items` and `POST /v1/responses/{id}/cancel`.

The request is translated into the core's chat request (`proxy.protocols.responses`), answered
by `proxy.api.serving.serve` like any chat call, and the answer translated back: a `response`
object, or typed events. A response is read back by rendering its stored call again.

`store: false`: the response cannot be read back by id, nor named as `previous_response_id`;
its call is still recorded (and trained on) like every call: rlproxy learns from what it serves.
`DELETE` does the same to a stored response; the call stays in its trajectory.

Hosted tools a request declares (`web_search`, ...) are not offered to the model: the answer
names them in `X-RLProxy-Ignored-Tools` and the log says so (`proxy.protocols.responses_tools`).
Other fields with no effect here (`reasoning.summary`, ...) are named in
`X-RLProxy-Ignored-Fields` (`proxy.protocols.responses.ignored_fields`).
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from proxy.api.auth import Caller, Principal
from proxy.api.body import TextJSONRoute
from proxy.api.deps import Generating, Registry, StoreDep, request_id
from proxy.api.serving import serve
from proxy.chat.record import CallInfo
from proxy.chat.streaming import JSON_OR_SSE, SSE_HEADERS, typed_sse
from proxy.errors import InvalidRequestError
from proxy.protocols import responses
from proxy.protocols.responses import ResponsesRequest
from proxy.protocols.responses_tools import IGNORED_HEADER
from storage.records import StoredCall
from storage.store import Store

logger = logging.getLogger(__name__)
router = APIRouter(route_class=TextJSONRoute)


@router.post("/v1/responses", responses=JSON_OR_SSE)
async def create_response(
    body: ResponsesRequest, request: Request, runtime: Generating, caller: Caller
):
    previous = None
    if body.previous_response_id is not None:
        stored = await _stored(runtime.store, body.previous_response_id, caller, chaining=True)
        previous = responses.previous_turn(stored)
    chat, wire = responses.to_chat(body, previous)
    rid = request_id(request)
    call = CallInfo(
        chat,
        rid,
        dict(request.headers),
        owner=caller.owner,
        client_ref=caller.client_ref,
        protocol="responses",
        wire=wire,
        retrievable=body.stores,
        chained_trajectory_id=previous.trajectory_id if previous else None,
        ignored=responses.ignored_fields(body),
    )
    answer = await serve(request, runtime, caller, call)
    headers = dict(answer.headers)
    if wire.get("ignored_tools"):
        ignored = ", ".join(wire["ignored_tools"])
        logger.info("request %s: hosted tools not offered to the model: %s", rid, ignored)
        headers[IGNORED_HEADER] = ignored
    if answer.chunks is not None:
        events = responses.Events(call.completion_id, answer.model, chat, wire, call.started_at)
        return StreamingResponse(
            typed_sse(events.run(answer.chunks)),
            media_type="text/event-stream",
            headers={**SSE_HEADERS, **headers},
        )
    if answer.body is None:  # nobody is listening any more; the call is stored as disconnected
        return Response(status_code=499)
    response = responses.render(call.completion_id, answer.model, chat, wire, answer.body)
    return JSONResponse(response, headers=headers)


@router.get("/v1/responses/{response_id}")
async def get_response(
    response_id: str, store: StoreDep, registry: Registry, caller: Caller
) -> dict[str, Any]:
    stored = await _stored(store, response_id, caller)
    record = stored.record
    # The model its answer named: an upstream model's name as asked, or the policy's version
    # stored on the call.
    if record.engine == "upstream":
        model = record.model_requested
    else:
        model = registry.version_id(record.adapter_version)
    return responses.from_call(stored, model)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, store: StoreDep, caller: Caller) -> dict[str, Any]:
    await _stored(store, response_id, caller)
    if not await store.forget_response(response_id):
        raise responses.not_found(response_id)
    return {"id": response_id, "object": "response", "deleted": True}


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, store: StoreDep, caller: Caller) -> dict[str, Any]:
    await _stored(store, response_id, caller)
    raise InvalidRequestError(
        "Only responses created with background=true can be cancelled; this server answers "
        "every response in the foreground.",
        param="response_id",
    )


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(
    response_id: str,
    store: StoreDep,
    caller: Caller,
    after: str | None = None,
    limit: int = Query(20, ge=1, le=100),
    order: Literal["asc", "desc"] = "desc",
) -> dict[str, Any]:
    items = responses.input_items(await _stored(store, response_id, caller))
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item["id"] for item in items]
        items = items[ids.index(after) + 1 :] if after in ids else []
    page = items[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None,
        "has_more": len(items) > limit,
    }


async def _stored(
    store: Store, response_id: str, caller: Principal, *, chaining: bool = False
) -> StoredCall:
    """The stored response `response_id` names, if this caller may read it: a 404 otherwise
    (another key's responses are not told apart from missing ones)."""
    stored = None
    if response_id.startswith("resp_"):
        stored = await store.call_by_completion_id(response_id)
    if stored is None or stored.record.protocol != "responses" or not stored.record.retrievable:
        raise responses.not_found(response_id)
    _, owner = await store.trajectory_owner(stored.trajectory_id)
    if not (owner == caller.key_id if chaining else caller.may_see(owner)):
        raise responses.not_found(response_id)
    if chaining and stored.record.status != "completed":
        raise InvalidRequestError(
            f"Previous response '{response_id}' did not complete ({stored.record.status}); "
            "continue from a completed one.",
            param="previous_response_id",
        )
    return stored
