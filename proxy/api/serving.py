"""The one path every protocol's route takes to an answer: a translated call in, the chat core's
body or chunk stream out.

    call = CallInfo(chat_request, request_id(request), dict(request.headers), protocol="messages")
    answer = await serve(request, runtime, caller, call)
    answer.body        # non-streamed: the core's body (Chat Completions' shape), or
    answer.chunks      # streamed: the core's chunks, for the protocol's edge to re-frame
    answer.model       # the model the answer names: the version that served it, `NAME@N`
    answer.headers     # what every protocol's answer carries (X-RLProxy-Version,
                       # -Output-Budget, -Ignored-Fields)

Whichever protocol a request came in by (`proxy/protocols/` translates it into a
`ChatCompletionRequest`), it is served here the same way: an upstream model name goes to the
upstream service, every other name to the policy's `ChatService` (the local or the vllm engine),
the caller's ownership of a named trajectory is checked, and a client that leaves before a
non-streamed answer cancels its generation. The protocol's route only translates in and out.

An answer of the policy names the version that served it, the one its call row stores: as its
`model` (`NAME@N`, `NAME@base`, whatever name was asked for) and in `X-RLProxy-Version` (`N` or
`base`), streams included (the version is fixed before the first byte). An upstream model's
answer keeps the name asked for and has no version header: no version of the policy served it.

An answer of the policy also names the request's fields that were accepted and had no effect
(`call.ignored`, each protocol's `ignored_fields`) in `X-RLProxy-Ignored-Fields`, a
comma-separated list of paths (`thinking, output_config.effort`), absent when there are none; the
log says so at debug level, one line per request. An upstream model's answer does not: the
provider, not rlproxy, decides what the forwarded fields do.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request

from proxy.adapters.registry import version_label
from proxy.api.auth import PermissionDeniedError, Principal
from proxy.api.http_metrics import label_model
from proxy.chat.budget import HEADER as BUDGET_HEADER
from proxy.chat.budget import OutputBudget
from proxy.chat.record import CallInfo
from proxy.chat.streaming import prepend
from proxy.runtime import Runtime
from storage.store import Store

T = TypeVar("T")
logger = logging.getLogger(__name__)

VERSION_HEADER = "X-RLProxy-Version"
IGNORED_FIELDS_HEADER = "X-RLProxy-Ignored-Fields"


@dataclass
class Answer:
    """What the core made of a call: exactly one of `body` and `chunks`, or neither when the
    client left before a non-streamed answer (the call is stored as disconnected)."""

    model: str
    """The model the answer names: the policy's version that served it (`NAME@N`,
    `NAME@base`), or an upstream model's name as asked."""
    version: str | None = None
    """The policy's version that served it, `N` or `base` (`X-RLProxy-Version`); None for an
    upstream model."""
    body: dict[str, Any] | None = None
    chunks: AsyncIterator[dict[str, Any]] | None = None
    prompt_tokens: int | None = None
    """The prompt's length in tokens when known before generating (the policy's engines)."""
    budget: OutputBudget | None = None
    """The answer's budget, asked for and used (the policy's engines; an upstream model's
    provider keeps its own)."""
    ignored: tuple[str, ...] = ()
    """The request's fields accepted with no effect (the policy's engines), by path."""

    @property
    def disconnected(self) -> bool:
        return self.body is None and self.chunks is None

    @property
    def headers(self) -> dict[str, str]:
        """Headers every protocol's answer of the policy carries: `X-RLProxy-Version`,
        `X-RLProxy-Output-Budget` and, when the request had fields with no effect,
        `X-RLProxy-Ignored-Fields`."""
        headers = {}
        if self.version is not None:
            headers[VERSION_HEADER] = self.version
        if self.budget is not None:
            headers[BUDGET_HEADER] = self.budget.header_value()
        if self.ignored:
            headers[IGNORED_FIELDS_HEADER] = ", ".join(self.ignored)
        return headers


async def serve(request: Request, runtime: Runtime, caller: Principal, call: CallInfo) -> Answer:
    served = runtime.served
    assert served is not None  # `Generating` refuses a runtime without serving
    body = call.request
    label_model(request.scope, body.model)
    await check_trajectory_owner(call, caller, runtime.store)
    upstream = served.upstream
    if upstream is not None and upstream.serves(body.model):
        if not body.stream:
            return Answer(body.model, body=await upstream.complete(call))
        chunks = upstream.stream(call)
        # Wait for the provider's first chunk: a failure before it is still an HTTP error status.
        first = await anext(chunks, None)
        return Answer(body.model, chunks=prepend(first, chunks))
    await served.adapters.ensure_servable(body.model)
    chat = served.chat
    prepared = await chat.prepare(call)
    answer = Answer(
        chat.served_model(prepared),
        version_label(prepared.resolved.version),
        prompt_tokens=len(prepared.prompt_ids),
        budget=prepared.budget,
        ignored=call.ignored,
    )
    if call.ignored:
        logger.debug(
            "request %s: accepted with no effect: %s", call.request_id, ", ".join(call.ignored)
        )
    if body.stream:
        answer.chunks = chat.stream(prepared)
    else:
        answer.body = await unless_disconnected(request, chat.complete(prepared))
    return answer


async def check_trajectory_owner(call: CallInfo, caller: Principal, store: Store) -> None:
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


async def unless_disconnected(request: Request, work: Coroutine[Any, Any, T]) -> T | None:
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
