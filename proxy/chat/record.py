"""The one place a chat call becomes a `storage.records.CallRecord`, for every engine.

    record = call_record(call, status="completed", choices=[...], response=body, usage=usage)
    await store.record_call(record)   # committed before the response is acknowledged

`CallInfo` is what is known when a request arrives (the request, its id, its headers, when it
started); `call_record` completes it with how the call ended. Both the local service and the
upstream service build their records here, so the explicit ids a client may send (trajectory
and group keys), the retry count and the session lane (`proxy.chat.sessions`) are read one way
only; the caller (`owner`, `client_ref`) comes from `proxy.api.auth`. The linking rule itself
lives in `storage.linking` and runs inside the store.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from proxy.chat.budget import RECORD_KEY as OUTPUT_BUDGET
from proxy.chat.budget import OutputBudget
from proxy.chat.sessions import session_lane
from proxy.protocols.chat import ChatCompletionRequest, completion_id
from storage.records import LOGPROBS_AFTER_GRAMMAR, CallRecord, CallStatus, ChoiceRecord

TRAJECTORY_HEADER = "x-rlproxy-trajectory"
GROUP_HEADER = "x-rlproxy-group"
HELD_OUT_HEADER = "x-rlproxy-held-out"
RETRY_HEADER = "x-stainless-retry-count"


@dataclass(frozen=True)
class RequestDump:
    """A chat request as plain JSON values, dumped once (`model_dump(exclude_none=True,
    by_alias=True)`): validation, the prompt, the grammar, routing keys and the call record all
    read this one form."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    """None when the request has none (an empty list too)."""
    fields: dict[str, Any]
    """Every other top-level field by its wire name, unknown ones included."""
    unknown: frozenset[str] = frozenset()
    """The top-level fields rlproxy does not know (`ChatCompletionRequest.unknown_fields`)."""

    @classmethod
    def of(cls, req: ChatCompletionRequest) -> RequestDump:
        fields = req.model_dump(exclude_none=True, by_alias=True)
        messages = fields.pop("messages")
        tools = fields.pop("tools", None) or None
        return cls(messages, tools, fields, frozenset(req.unknown_fields()))

    @property
    def params(self) -> dict[str, Any]:
        """The request's known parameters, as stored; messages, tools and model have columns
        of their own.

        Top-level fields rlproxy does not know are not stored (they are logged by name when
        the request is validated): a client's junk, or a key it put in the body, never reaches
        the database."""
        return {k: v for k, v in self.fields.items() if k != "model" and k not in self.unknown}


@dataclass
class CallInfo:
    """A call as it arrived: everything its record needs before the answer exists."""

    request: ChatCompletionRequest
    request_id: str
    headers: dict[str, str] = field(default_factory=dict)
    started_at: float = field(default_factory=time.time)
    """Epoch seconds when the request arrived."""
    started: float = field(default_factory=time.monotonic)
    """The same moment on the monotonic clock, for the latency."""
    owner: str | None = None
    """The API key that owns the call and its trajectory (None when the server has no keys)."""
    client_ref: str | None = None
    """Who called: the key id, or a salted hash of an unregistered bearer token."""
    first_token: float | None = None
    """When the first token was generated, on the monotonic clock (None: none yet)."""
    protocol: str = "chat"
    """The wire protocol the request came in by ("chat", "responses", "messages"); `request`
    is its translation into the one shape every engine serves (`proxy.protocols`)."""
    chained_trajectory_id: str | None = None
    """The trajectory an explicit link names (a Responses `previous_response_id`): the call
    joins it unless the client names another one itself."""
    wire: dict[str, Any] | None = None
    """What the protocol's edge keeps of the request beside the translation (stored under
    `params[protocol]`, read back by that edge only)."""
    retrievable: bool | None = None
    """A Responses API call that `GET /v1/responses/{id}` may read back (its `store` flag)."""
    stopped_by: dict[int, str] = field(default_factory=dict)
    """Choice index -> the stop string that ended it, filled in by the chat service as choices
    finish (Anthropic's `stop_sequence`; the chat wire has no field for it)."""
    ignored: tuple[str, ...] = ()
    """The request's fields that were accepted and have no effect, by path (`thinking`,
    `reasoning.summary`), never by value: each protocol's `ignored_fields`, named in the answer's
    `X-RLProxy-Ignored-Fields` (`proxy.api.serving`). Not stored."""

    def __post_init__(self) -> None:
        self.headers = {k.lower(): v for k, v in self.headers.items()}

    def token_arrived(self) -> None:
        """Note the first generated token (later calls change nothing)."""
        if self.first_token is None:
            self.first_token = time.monotonic()

    @property
    def explicit_trajectory_id(self) -> str | None:
        req = self.request
        named = explicit_id(self.headers, req.metadata, req.rlproxy, "trajectory")
        return named or self.chained_trajectory_id

    @property
    def marked_held_out(self) -> bool:
        """The client marked the call's task as held out of training (an evaluation run: the
        `X-RLProxy-Held-Out` header, `metadata.held_out` or the body's `rlproxy.held_out`, any
        of "true", "1", "yes"), whatever `RLPROXY_EVAL_SHARE`'s draw says (`storage.held_out`)."""
        req = self.request
        return held_out_flag(self.headers, req.metadata, req.rlproxy)

    @property
    def completion_id(self) -> str:
        """The id the client sees: `chatcmpl-...`, `resp_...` or `msg_...` by protocol."""
        return completion_id(self.request_id, self.protocol)

    @property
    def created(self) -> int:
        """The `created` field of the response (whole epoch seconds)."""
        return int(self.started_at)


def call_record(
    call: CallInfo,
    *,
    engine: str,
    status: CallStatus,
    choices: Sequence[ChoiceRecord] = (),
    response: dict[str, Any] | None = None,
    usage: dict[str, Any] | None = None,
    error: str | None = None,
    dumped: RequestDump | None = None,
    prompt_token_ids: list[int] | None = None,
    adapter_version: int | None = None,
    shadow_samples: Sequence[ChoiceRecord] = (),
    token_ids_note: str | None = None,
    logprobs_after_grammar: bool = False,
    output_budget: OutputBudget | None = None,
    held_out: bool = False,
) -> CallRecord:
    """The record of one finished (or failed, or abandoned) call.

    `dumped`: the request as validation dumped it (`PreparedChat.dumped`); dumped here when
    not given (the upstream service validates nothing). `output_budget`
    (the policy's calls) is stored as `params["output_budget"]`, `{"requested", "used"}`,
    beside the request's own `max_tokens` / `max_completion_tokens` (what was asked for, as
    ever). `held_out`: the call's task is held out of training (`storage.held_out`).
    """
    req, headers = call.request, call.headers
    latency = time.monotonic() - call.started
    dumped = dumped or RequestDump.of(req)
    params = dumped.params
    if logprobs_after_grammar:
        params[LOGPROBS_AFTER_GRAMMAR] = True
    if output_budget is not None:
        params[OUTPUT_BUDGET] = output_budget.as_params()
    if call.wire is not None:
        params[call.protocol] = call.wire
    lane = session_lane(headers)
    return CallRecord(
        id=uuid.uuid4().hex,
        request_id=call.request_id,
        completion_id=call.completion_id,
        created_at=call.started_at,
        finished_at=call.started_at + latency,
        model_requested=req.model,
        adapter_version=adapter_version,
        engine=engine,
        request_messages=dumped.messages,
        tools=dumped.tools,
        params=params,
        response=response,
        choices=list(choices),
        shadow_samples=list(shadow_samples),
        prompt_token_ids=prompt_token_ids,
        usage=usage,
        latency_s=latency,
        status=status,
        error=error,
        api_key_id=call.client_ref,
        owner_key_id=call.owner,
        stream=bool(req.stream),
        token_ids_note=token_ids_note,
        explicit_trajectory_id=call.explicit_trajectory_id,
        explicit_group_key=explicit_id(headers, req.metadata, req.rlproxy, "group"),
        retry_count=retry_count(headers.get(RETRY_HEADER)),
        time_to_first_token_s=None if call.first_token is None else call.first_token - call.started,
        protocol=call.protocol,
        retrievable=call.retrievable,
        session_lane=lane.lane if lane else None,
        parent_lane=lane.parent if lane else None,
        held_out=held_out,
    )


def explicit_id(
    headers: Mapping[str, str],
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


def held_out_flag(
    headers: Mapping[str, str], metadata: dict[str, Any] | None, body_ext: dict[str, Any] | None
) -> bool:
    """The header wins, then `metadata.held_out`, then the body's `rlproxy.held_out`."""
    value: Any = headers.get(HELD_OUT_HEADER)
    if value is None:
        for source in (metadata, body_ext):
            if (source or {}).get("held_out") is not None:
                value = (source or {})["held_out"]
                break
    return str(value).strip().lower() in ("true", "1", "yes")


def retry_count(value: str | None) -> int:
    """The client's retry count (`x-stainless-retry-count`): 0 when absent, unreadable or
    negative. A header is the client's to send; a bad one never fails the call it rides on."""
    try:
        return max(0, int(value)) if value else 0
    except ValueError:
        return 0
