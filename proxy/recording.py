"""The call sink: turn a finished chat call into a `storage.records.CallRecord` and store it.

`ChatService` awaits `CallRecorder.__call__` before it acknowledges a response (the body of a
non-streamed response, the `[DONE]` of a stream), so a call a client saw complete is committed.
This module extracts the explicit ids a client may send (trajectory and group keys, retry count,
API key id); the linking policy itself lives in `trainer.linking` and runs inside the store.
"""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from typing import Any

from proxy.chat import ChatOutcome, ChoiceOutcome
from storage.records import CallRecord, ChoiceRecord
from storage.store import Store

logger = logging.getLogger(__name__)

TRAJECTORY_HEADER = "x-rlproxy-trajectory"
GROUP_HEADER = "x-rlproxy-group"
RETRY_HEADER = "x-stainless-retry-count"


class CallRecorder:
    def __init__(self, store: Store, engine_kind: str = "local") -> None:
        self.store = store
        self.engine_kind = engine_kind

    async def __call__(self, outcome: ChatOutcome) -> None:
        await self.store.record_call(to_record(outcome, self.engine_kind))


def to_record(outcome: ChatOutcome, engine_kind: str = "local") -> CallRecord:
    prep = outcome.prepared
    req = prep.request
    headers = {k.lower(): v for k, v in prep.headers.items()}
    finished = time.time()
    return CallRecord(
        id=uuid.uuid4().hex,
        request_id=prep.request_id,
        created_at=finished - outcome.latency_s,
        finished_at=finished,
        model_requested=req.model,
        adapter_version=prep.resolved.version,
        engine=engine_kind,
        request_messages=prep.messages,
        tools=prep.tools,
        params=_params(req),
        response=outcome.response,
        choices=[_choice(c) for c in outcome.choices],
        shadow_samples=[_choice(c) for c in outcome.shadow],
        prompt_token_ids=prep.prompt_ids,
        usage=outcome.usage,
        latency_s=outcome.latency_s,
        status=outcome.status,  # type: ignore[arg-type]
        error=outcome.error,
        api_key_id=api_key_id(headers.get("authorization")),
        stream=bool(req.stream),
        explicit_trajectory_id=explicit_id(headers, req.metadata, req.rlproxy, "trajectory"),
        explicit_group_key=explicit_id(headers, req.metadata, req.rlproxy, "group"),
        retry_count=_int(headers.get(RETRY_HEADER)),
        completion_id=prep.id,
    )


def _choice(c: ChoiceOutcome) -> ChoiceRecord:
    return ChoiceRecord(
        index=c.index,
        message=c.message,
        finish_reason=c.finish_reason,
        completion_token_ids=c.completion_token_ids,
        completion_logprobs=c.completion_logprobs,
    )


def explicit_id(
    headers: dict[str, str],
    metadata: dict[str, Any] | None,
    body_ext: dict[str, Any] | None,
    kind: str,
) -> str | None:
    """The header wins, then `metadata.<kind>_id`, then the body's `rlproxy.<kind>_id`."""
    header = headers.get(TRAJECTORY_HEADER if kind == "trajectory" else GROUP_HEADER)
    if header:
        return header
    for source in (metadata, body_ext):
        value = (source or {}).get(f"{kind}_id")
        if value:
            return str(value)
    return None


def api_key_id(authorization: str | None) -> str | None:
    """A stable, non-reversible id for the client's bearer key (never the key itself)."""
    if not authorization or not authorization.lower().startswith("bearer "):
        return None
    key = authorization[7:].strip()
    return "key_" + hashlib.sha256(key.encode()).hexdigest()[:16] if key else None


def _params(req: Any) -> dict[str, Any]:
    """The request's parameters; messages, tools and model have columns of their own."""
    params: dict[str, Any] = req.model_dump(
        exclude_none=True, by_alias=True, exclude={"messages", "tools", "model"}
    )
    return params


def _int(value: str | None) -> int:
    try:
        return int(value) if value else 0
    except ValueError:
        return 0
