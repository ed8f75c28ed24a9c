"""OpenAI Chat Completions wire types, as rlproxy accepts and returns them.

Request models mirror https://platform.openai.com/docs/api-reference/chat/create field by field,
in the spec's order. They allow extra fields: clients send fields rlproxy has never heard of, and
those are ignored rather than refused, and named in the answer's `X-RLProxy-Ignored-Fields` with
the known fields that have no effect here (`ignored_fields`). Fields that are not in OpenAI's spec
are marked "rlproxy extension". Numbers are strict, as OpenAI's are: `"max_tokens": "5"` or `5.0`
is a 400, never coerced (a float field takes a JSON integer, as JSON has one number type).

Responses are plain dicts built by the helpers at the bottom: they are produced on the hot path
(one per streamed token) and must match OpenAI's JSON exactly, nulls included. Their `model` is
what served the answer (the policy's version, `NAME@N` or `NAME@base`; an upstream model's name
as asked), and `system_fingerprint` is that same name: it changes when the weights behind the
answer do, which is what OpenAI's fingerprint tells a client.

These are also the core's shapes: `proxy.chat` serves a `ChatCompletionRequest` for every engine,
and the other protocols (`responses`, `messages`) translate into and out of it. No rlproxy
imports here, so every room may use them.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, model_validator

logger = logging.getLogger(__name__)


class OpenAIModel(BaseModel):
    """Base for wire types: unknown fields are kept (and reported), never a 4xx."""

    model_config = ConfigDict(extra="allow")

    def unknown_fields(self) -> list[str]:
        return sorted((self.model_extra or {}).keys())


class FunctionCall(OpenAIModel):
    name: str
    arguments: str = ""


class ToolCall(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    # rlproxy extension (vLLM's and DeepSeek's name, which Qwen3's template reads): the reasoning
    # an earlier assistant turn showed (an Anthropic thinking block's text, a Responses
    # reasoning item's). Kept in the stored turn; rendered only by a template with a place for
    # it (`proxy.chat.prompt`).
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"messages with role '{self.role}' must have content")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("messages with role 'tool' must have a tool_call_id")
        return self


class FunctionDefinition(OpenAIModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedToolChoice(OpenAIModel):
    type: Literal["function"] = "function"
    function: dict[str, str]


class JsonSchemaFormat(OpenAIModel):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(OpenAIModel):
    include_usage: bool | None = None


class ChatCompletionRequest(OpenAIModel):
    messages: list[ChatMessage] = Field(min_length=1)
    model: str
    audio: dict[str, Any] | None = None
    frequency_penalty: StrictFloat | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = None
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    max_tokens: StrictInt | None = Field(None, ge=1)
    metadata: dict[str, Any] | None = None
    modalities: list[str] | None = None
    n: StrictInt | None = Field(None, ge=1)
    parallel_tool_calls: bool | None = None
    presence_penalty: StrictFloat | None = Field(None, ge=-2.0, le=2.0)
    prompt_cache_key: str | None = None
    reasoning_effort: str | None = None
    response_format: ResponseFormat | None = None
    seed: StrictInt | None = None
    service_tier: str | None = None
    stop: str | list[str] | None = None
    store: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    temperature: StrictFloat | None = Field(None, ge=0.0, le=2.0)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    tools: list[Tool] | None = None
    top_logprobs: StrictInt | None = Field(None, ge=0)
    top_p: StrictFloat | None = Field(None, gt=0.0, le=1.0)
    # rlproxy extension (as vLLM's): sample from the k most likely tokens only
    top_k: StrictInt | None = Field(None, ge=1)
    user: str | None = None
    # rlproxy extension: {"trajectory_id": ..., "group_id": ...}
    rlproxy: dict[str, Any] | None = None

    @property
    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        return tuple(s for s in stops if s)


# ----------------------------------------------------------------------------- ignored fields

MAX_NAMED = 32
"""At most this many fields are named in `X-RLProxy-Ignored-Fields` (then "+N more")."""
_PLAIN_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")

_CHAT_NO_EFFECT: dict[str, tuple[Any, ...]] = {
    # field: the values that ask for nothing rlproxy does not do anyway (not named)
    "audio": (),
    "logit_bias": ({},),
    "modalities": (["text"],),
    "reasoning_effort": ("none",),  # the served models do not reason aloud
    "service_tier": ("auto", "default"),  # one tier: the answer says "default"
    "store": (True,),  # every call is stored and trained on, `store: false` too
}
"""Chat Completions fields rlproxy accepts and does nothing with. The rest it honours:
`metadata` and `user` are kept with the stored call (`metadata.trajectory_id` / `group_id`
name its trajectory and group), `prompt_cache_key` keys the replica a conversation goes to
(`proxy.chat.affinity`), and sampling, tools and formats are served."""


def plain_names(model: BaseModel, prefix: str = "", honoured: Iterable[str] = ()) -> list[str]:
    """`prefix` + the name of each field of `model` rlproxy does not know, but those in
    `honoured`. A name that is not plain (letters, digits, `_`, `-`, `.`; at most 64) is left
    out: a header never carries a client's arbitrary text."""
    skip = set(honoured)
    return [
        prefix + name
        for name in (model.model_extra or {})
        if name not in skip and _PLAIN_NAME.fullmatch(name)
    ]


def plain(name: Any) -> bool:
    """Whether `name` may be named in a header (see `plain_names`)."""
    return isinstance(name, str) and _PLAIN_NAME.fullmatch(name) is not None


def field_paths(names: Iterable[str]) -> tuple[str, ...]:
    """`names` as `X-RLProxy-Ignored-Fields` lists them: each once, sorted, at most
    `MAX_NAMED` (then "+N more")."""
    unique = sorted(set(names))
    if len(unique) <= MAX_NAMED:
        return tuple(unique)
    return (*unique[:MAX_NAMED], f"+{len(unique) - MAX_NAMED} more")


def ignored_fields(req: ChatCompletionRequest) -> tuple[str, ...]:
    """The fields of `req` rlproxy accepts and does nothing with, by name, never by value: the
    known ones of `_CHAT_NO_EFFECT` set to a value that asks for something, and every unknown
    top-level field."""
    named = plain_names(req)
    for name, nothing in _CHAT_NO_EFFECT.items():
        value = getattr(req, name)
        if value is not None and value not in nothing:
            named.append(name)
    return field_paths(named)


# ----------------------------------------------------------------------------- responses


ID_PREFIXES = {"chat": "chatcmpl-", "responses": "resp_", "messages": "msg_"}
"""What each protocol's ids start with (OpenAI's `chatcmpl-` and `resp_`, Anthropic's `msg_`)."""


def completion_id(request_id: str, protocol: str = "chat") -> str:
    """The id a response carries: `chatcmpl-req_<hex>` (the request id, as ever) for chat;
    `resp_<hex>` and `msg_<hex>`, the request id's hex, for the other two."""
    if protocol == "chat":
        return f"chatcmpl-{request_id}"
    return ID_PREFIXES[protocol] + request_id.removeprefix("req_")


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
        "completion_tokens_details": {
            "reasoning_tokens": 0,
            "audio_tokens": 0,
            "accepted_prediction_tokens": 0,
            "rejected_prediction_tokens": 0,
        },
    }


def assistant_message(content: str | None, tool_calls: list[dict[str, Any]]) -> dict[str, Any]:
    message: dict[str, Any] = {
        "role": "assistant",
        "content": content,
        "refusal": None,
        "annotations": [],
    }
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def completion_body(
    *,
    id: str,
    model: str,
    created: int,
    choices: list[dict[str, Any]],
    usage_: dict[str, Any],
) -> dict[str, Any]:
    return {
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_,
        "service_tier": "default",
        "system_fingerprint": model,
    }


def chunk(
    *,
    id: str,
    model: str,
    created: int,
    choices: list[dict[str, Any]],
    usage_: dict[str, Any] | None = None,
    include_usage_field: bool = False,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "service_tier": "default",
        "system_fingerprint": model,
        "choices": choices,
    }
    if include_usage_field:
        body["usage"] = usage_
    return body
