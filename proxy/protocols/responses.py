"""OpenAI's Responses API (`POST /v1/responses`) at the edge of the one chat core.

    chat, wire = to_chat(request, previous)       # items -> the core's chat request
    body = render(response_id, ..., core_body)    # the core's body -> a `response` object
    async for event in Events(...).run(chunks)    # the core's chunks -> typed SSE events

Input is a string or a list of items: messages (roles user, system, developer, assistant, with
a string or `input_text`/`output_text`/`input_image` parts), `function_call`,
`function_call_output` and `reasoning`; `instructions` become the first (system) message. A
`reasoning` item's text (its `content`, else its `summary`) is the `reasoning_content` of the
assistant message or call that follows it, kept in the stored turn; its `encrypted_content`
cannot be read here. A
`previous_response_id` puts the stored conversation before the new input (without the earlier
`instructions`, as OpenAI does) and names the earlier call's trajectory: the chain is one
trajectory by construction. Tools are flat function definitions and namespaces of them; hosted
tools are accepted and not offered to the model (`responses_tools`); `text.format` is the core's
`response_format`; `max_output_tokens` its `max_tokens` (the budget asked for, echoed as sent;
`proxy.chat.budget` fits it to the context); `include: ["message.output_text.logprobs"]` its
`logprobs`; `prompt_cache_key` the core's, which keys the replica a conversation goes to.

A response's `model` is what served it, as the route names it (the policy's version,
`NAME@N`), not the name asked for. A stored call is read back (`GET /v1/responses/{id}`) by
rendering its row again (`from_call`, the version stored on the row), so what GET returns is
what POST returned, logprobs aside (the row keeps the sampled token's logprob only). Item ids
are derived from the response id and the tool call ids, never random, so a second rendering
gives the same ids.

What has no effect here is named by `ignored_fields` (the route's `X-RLProxy-Ignored-Fields`):
`reasoning.*` (this server's models do not reason aloud), `include` values other than
`message.output_text.logprobs` (`reasoning.encrypted_content`: no reasoning items come back),
`truncation: "auto"` (an over-long prompt is refused, never cut), `text.verbosity`, a reasoning
item's `encrypted_content` (and `input.reasoning` for one no answer follows), a `service_tier`
other than the default, and unknown fields (`client_metadata`, ...).

Not supported (a 400 that says so): `custom` tools, `conversation` objects, `background`,
`prompt` templates, `item_reference` items, and `input_file` parts.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import Field, StrictFloat, StrictInt, ValidationError

from proxy.errors import APIError, InvalidRequestError, NotFoundError
from proxy.protocols import responses_tools
from proxy.protocols.chat import (
    ChatCompletionRequest,
    OpenAIModel,
    field_paths,
    plain,
    plain_names,
)
from proxy.protocols.responses_tools import client_name, core_name
from storage.records import StoredCall

LOGPROBS_INCLUDE = "message.output_text.logprobs"
_NOT_SUPPORTED = {
    "conversation": "Conversation objects are not supported by this server; chain turns with "
    "'previous_response_id' or send the whole conversation as 'input'.",
    "prompt": "Prompt templates are not supported by this server; send 'input' and 'instructions'.",
    "background": "Background responses are not supported by this server.",
}
_TEXT_PARTS = {"input_text", "output_text", "text"}


class TextFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(OpenAIModel):
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(OpenAIModel):
    """`POST /v1/responses`, as https://platform.openai.com/docs/api-reference/responses/create
    lists it. Unknown fields are logged and ignored, as on the chat route."""

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: StrictInt | None = Field(None, ge=1)
    temperature: StrictFloat | None = Field(None, ge=0.0, le=2.0)
    top_p: StrictFloat | None = Field(None, gt=0.0, le=1.0)
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    include: list[str] | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    stream: bool | None = None
    user: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None
    # rlproxy extension: {"trajectory_id": ..., "group_id": ...}
    rlproxy: dict[str, Any] | None = None

    @property
    def stores(self) -> bool:
        return self.store is not False


# ----------------------------------------------------------------------------- in


def ignored_fields(req: ResponsesRequest) -> tuple[str, ...]:
    """The fields of `req` that are accepted and have no effect here, by path, never by value
    (the module docstring says why each). Hosted tools are named apart
    (`X-RLProxy-Ignored-Tools`)."""
    named = plain_names(req, honoured=_NOT_SUPPORTED)
    for key, value in (req.reasoning or {}).items():
        if value is not None and not (key == "effort" and value == "none") and plain(key):
            named.append(f"reasoning.{key}")
    for value in req.include or []:
        if value != LOGPROBS_INCLUDE:
            named.append(f"include[{value}]" if plain(value) else "include")
    if req.truncation not in (None, "disabled"):
        named.append("truncation")
    if req.service_tier not in (None, "auto", "default"):
        named.append("service_tier")
    if req.text is not None:
        if req.text.verbosity not in (None, "medium"):
            named.append("text.verbosity")
        named += plain_names(req.text, "text.")
    if isinstance(req.input, list):
        named += _ignored_in_reasoning(req.input)
    return field_paths(named)


def _ignored_in_reasoning(items: list[Any]) -> list[str]:
    """`input.reasoning.encrypted_content` when a reasoning item carries it, `input.reasoning`
    when a reasoning item's text has no answer after it to join (`input_messages`' rule)."""
    named: list[str] = []
    waiting = False
    for item in items:
        if not isinstance(item, dict):
            continue
        if item.get("type") == "reasoning":
            if item.get("encrypted_content"):
                named.append("input.reasoning.encrypted_content")
            waiting = waiting or bool(_reasoning_text(item))
        elif _answers(item):
            waiting = False
        elif waiting:
            named.append("input.reasoning")
            waiting = False
    return [*named, "input.reasoning"] if waiting else named


@dataclass
class Previous:
    """The stored turn a `previous_response_id` names: its conversation (without its own
    instructions) and its answer, and the trajectory they are in."""

    messages: list[dict[str, Any]]
    trajectory_id: str


def previous_turn(stored: StoredCall) -> Previous:
    record = stored.record
    wire = record.params.get("responses") or {}
    history = list(record.request_messages)
    if wire.get("instructions") is not None and history:
        history = history[1:]  # instructions are not carried over to the next response
    if record.choices:
        answer = dict(record.choices[0].message)
        history.append(
            {
                "role": "assistant",
                "content": answer.get("content"),
                **({"tool_calls": answer["tool_calls"]} if answer.get("tool_calls") else {}),
            }
        )
    return Previous(history, stored.trajectory_id)


def to_chat(
    req: ResponsesRequest, previous: Previous | None = None
) -> tuple[ChatCompletionRequest, dict[str, Any]]:
    """The core's chat request for `req`, and what the edge keeps beside it (`wire`, stored
    under the call's `params["responses"]`). Raises `InvalidRequestError` (400)."""
    for name, why in _NOT_SUPPORTED.items():
        if (req.model_extra or {}).get(name):
            raise InvalidRequestError(why, param=name, code="unsupported_parameter")
    messages: list[dict[str, Any]] = []
    if req.instructions is not None:
        messages.append({"role": "system", "content": req.instructions})
    if previous is not None:
        messages.extend(previous.messages)
    input_start = len(messages)
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    messages.extend(input_messages(items))
    if not messages:
        raise InvalidRequestError("'input' must hold at least one item.", param="input")
    logprobs = LOGPROBS_INCLUDE in (req.include or [])
    tools = responses_tools.read_tools(req.tools)
    choice = _chat_tool_choice(req.tool_choice)
    if not tools.chat and choice == "auto":  # hosted tools only: nothing to choose from
        choice = None
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "tools": tools.chat or None,
        "tool_choice": choice,
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": _response_format(req.text),
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "logprobs": logprobs or None,
        "top_logprobs": req.top_logprobs if logprobs else None,
        "metadata": req.metadata,
        "user": req.user,
        "prompt_cache_key": req.prompt_cache_key,
        "stream": req.stream,
        "stream_options": {"include_usage": True} if req.stream else None,
        "rlproxy": req.rlproxy,
    }
    try:
        chat = ChatCompletionRequest.model_validate(
            {k: v for k, v in body.items() if v is not None}
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise InvalidRequestError(
            f"Invalid request: {first.get('msg', 'invalid')} (at {where}).", param="input"
        ) from exc
    wire = {
        "instructions": req.instructions,
        "input_start": input_start,
        "store": req.stores,
        "previous_response_id": req.previous_response_id,
        "tool_choice": req.tool_choice,
        "text": req.text.model_dump(exclude_none=True, by_alias=True) if req.text else None,
        "max_output_tokens": req.max_output_tokens,
        "top_logprobs": req.top_logprobs,
        "metadata": req.metadata,
        "parallel_tool_calls": req.parallel_tool_calls,
        **tools.wire(),
    }
    return chat, wire


def input_messages(items: list[Any]) -> list[dict[str, Any]]:
    """Responses input items as the core's chat messages. A `function_call` joins the
    assistant message before it (text and calls of one turn are one assistant message). A
    `reasoning` item's text joins the answer after it (an assistant message or a call) as its
    `reasoning_content`; with none before the next user or tool item, it is dropped."""
    out: list[dict[str, Any]] = []
    thoughts: list[str] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequestError(f"Invalid '{where}': expected an object.", param=where)
        kind = item.get("type", "message")
        if kind == "reasoning":
            thought = _reasoning_text(item)
            if thought:
                thoughts.append(thought)
            continue
        if not _answers(item):
            thoughts = []  # no answer followed it: named by `ignored_fields`
        before = len(out)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise InvalidRequestError(
                    f"Invalid '{where}.role': {role!r}. Supported values are: 'user', "
                    "'system', 'developer' and 'assistant'.",
                    param=f"{where}.role",
                )
            content = _content(
                item.get("content"), f"{where}.content", assistant=role == "assistant"
            )
            out.append({"role": role, "content": content})
        elif kind == "function_call":
            call = {
                "id": _text_field(item, "call_id", where),
                "type": "function",
                "function": {
                    "name": core_name(_text_field(item, "name", where), item.get("namespace")),
                    "arguments": _text_field(item, "arguments", where, empty_ok=True),
                },
            }
            if out and out[-1]["role"] == "assistant" and "tool_call_id" not in out[-1]:
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            if isinstance(output, list):
                output = _content(output, f"{where}.output", assistant=True)
            if not isinstance(output, str):
                raise InvalidRequestError(
                    f"Invalid '{where}.output': expected a string or a list of text parts.",
                    param=f"{where}.output",
                )
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": _text_field(item, "call_id", where),
                    "content": output,
                }
            )
        else:
            raise InvalidRequestError(
                f"Input items of type {kind!r} are not supported by this server; send "
                "'message', 'function_call', 'function_call_output' and 'reasoning' items.",
                param=f"{where}.type",
                code="unsupported_value",
            )
        if thoughts:  # an answer: a new assistant message, or a call joining the last one
            answer = out[-1] if len(out) == before else out[before]
            joined = [answer.get("reasoning_content"), *thoughts]
            answer["reasoning_content"] = "\n\n".join(t for t in joined if t)
            thoughts = []
    return out


def _answers(item: dict[str, Any]) -> bool:
    """Whether an input item is the model's answer: a reasoning item's text joins it."""
    kind = item.get("type", "message")
    return kind == "function_call" or (kind == "message" and item.get("role") == "assistant")


def _reasoning_text(item: dict[str, Any]) -> str:
    """A reasoning item's text: its `content` (`reasoning_text` parts, the reasoning itself)
    or else its `summary` (`summary_text` parts), joined by blank lines."""
    for key in ("content", "summary"):
        parts = item.get(key)
        texts = [
            part["text"]
            for part in (parts if isinstance(parts, list) else [])
            if isinstance(part, dict) and isinstance(part.get("text"), str) and part["text"]
        ]
        if texts:
            return "\n\n".join(texts)
    return ""


def _text_field(item: dict[str, Any], name: str, where: str, *, empty_ok: bool = False) -> str:
    value = item.get(name)
    if not isinstance(value, str) or (not value and not empty_ok):
        raise InvalidRequestError(
            f"Missing or invalid '{where}.{name}': expected a non-empty string.",
            param=f"{where}.{name}",
        )
    return value


def _content(content: Any, where: str, *, assistant: bool) -> str | list[dict[str, Any]]:
    """A string, or parts as the chat core's content parts; an assistant's text is one string
    (as the core stores the answers it gives, so a replayed turn links to its call)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(
            f"Invalid '{where}': expected a string or a list of content parts.", param=where
        )
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS or kind == "refusal":
            text = part.get("text", part.get("refusal"))
            if not isinstance(text, str):
                raise InvalidRequestError(f"Invalid '{at}.text': expected a string.", param=at)
            parts.append({"type": "text", "text": text})
        elif kind == "input_image" and not assistant:
            url = part.get("image_url")
            if not isinstance(url, str):
                raise InvalidRequestError(
                    f"Invalid '{at}': this server takes images by 'image_url' only.", param=at
                )
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise InvalidRequestError(
                f"Content parts of type {kind!r} are not supported here; send 'input_text' "
                "(or 'output_text' for an assistant's turn).",
                param=f"{at}.type",
                code="unsupported_value",
            )
    if assistant:
        return "".join(p["text"] for p in parts)
    return parts


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        name = core_name(choice["name"], choice.get("namespace"))
        return {"type": "function", "function": {"name": name}}
    raise InvalidRequestError(
        "Invalid 'tool_choice': this server takes 'auto', 'none', 'required' or "
        "{'type': 'function', 'name': ...}.",
        param="tool_choice",
    )


def _response_format(text: TextConfig | None) -> dict[str, Any] | None:
    fmt = text.format if text else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    schema = {"name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}
    if fmt.description is not None:
        schema["description"] = fmt.description
    return {"type": "json_schema", "json_schema": schema}


# ----------------------------------------------------------------------------- out


def message_item_id(response_id: str) -> str:
    return "msg_" + response_id.removeprefix("resp_")


def call_item_id(call_id: str) -> str:
    return "fc_" + call_id.removeprefix("call_")


def message_item(
    response_id: str, text: str, status: str, logprobs: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    return {
        "id": message_item_id(response_id),
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [output_text_part(text, logprobs)],
    }


def output_text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def call_item(
    call_id: str, name: str, arguments: str, status: str, wire: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A `function_call` item; `name` is the core's, given back as the request declared it
    (`name` and `namespace` for a namespace's function)."""
    namespace, declared = client_name(name, wire or {})
    item = {
        "id": call_item_id(call_id),
        "type": "function_call",
        "status": status,
        "call_id": call_id,
        "name": declared,
        "arguments": arguments,
    }
    if namespace is not None:
        item["namespace"] = namespace
    return item


def output_items(
    response_id: str,
    message: dict[str, Any],
    status: str,
    logprobs: list[dict[str, Any]] | None = None,
    wire: dict[str, Any] | None = None,
) -> list[dict[str, Any]]:
    """An assistant message of the core as output items: its text (when it has any, or when
    it made no call), then one `function_call` per tool call."""
    calls = message.get("tool_calls") or []
    text = message.get("content") or ""
    items = []
    if text or not calls:
        items.append(message_item(response_id, text, status, logprobs))
    for call in calls:
        fn = call.get("function") or {}
        items.append(
            call_item(call["id"], fn.get("name", ""), fn.get("arguments", ""), status, wire)
        )
    return items


def usage(prompt_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + output_tokens,
    }


def response_object(
    *,
    id: str,
    created_at: float,
    model: str,
    status: str,
    output: list[dict[str, Any]],
    wire: dict[str, Any],
    params: dict[str, Any],
    tools: list[dict[str, Any]] | None,
    usage_: dict[str, Any] | None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A `response` object. `wire`: what `to_chat` kept; `params` and `tools`: the core's."""
    return {
        "id": id,
        "object": "response",
        "created_at": int(created_at),
        "status": status,
        "background": False,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": wire.get("instructions"),
        "max_output_tokens": wire.get("max_output_tokens"),
        "max_tool_calls": None,
        "model": model,
        "output": output,
        "parallel_tool_calls": wire.get("parallel_tool_calls") is not False,
        "previous_response_id": wire.get("previous_response_id"),
        "reasoning": {"effort": None, "summary": None},
        "service_tier": "default",
        "store": wire.get("store", True),
        "temperature": params.get("temperature", 1.0),
        "text": wire.get("text") or {"format": {"type": "text"}},
        "tool_choice": wire.get("tool_choice") or "auto",
        "tools": responses_tools.echo(tools, wire),
        "top_logprobs": wire.get("top_logprobs") or 0,
        "top_p": params.get("top_p", 1.0),
        "truncation": "disabled",
        "usage": usage_,
        "user": params.get("user"),
        "metadata": wire.get("metadata") or {},
    }


def status_of(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def render(
    response_id: str,
    model: str,
    chat: ChatCompletionRequest,
    wire: dict[str, Any],
    core: dict[str, Any],
) -> dict[str, Any]:
    """The `response` object for a non-streamed answer of the core; `model`: what served it."""
    choice = core["choices"][0]
    status = status_of(choice.get("finish_reason"))
    logprobs = (choice.get("logprobs") or {}).get("content")
    u = core.get("usage") or {}
    return response_object(
        id=response_id,
        created_at=core["created"],
        model=model,
        status=status,
        output=output_items(response_id, choice["message"], status, logprobs, wire),
        wire=wire,
        params=chat.model_dump(exclude_none=True),
        tools=[t.model_dump(exclude_none=True) for t in chat.tools or []],
        usage_=usage(u.get("prompt_tokens", 0), u.get("completion_tokens", 0)),
    )


def from_call(stored: StoredCall, model: str) -> dict[str, Any]:
    """A stored Responses call as `GET /v1/responses/{id}` returns it; `model`: what served it,
    as the answer named it."""
    record = stored.record
    wire = record.params.get("responses") or {}
    prompt, completion = record.token_counts()
    if record.status != "completed" or not record.choices:
        status = "failed" if record.status == "error" else "cancelled"
        error = {"code": "server_error", "message": record.error or "The response did not finish."}
        output: list[dict[str, Any]] = []
    else:
        choice = record.choices[0]
        status, error = status_of(choice.finish_reason), None
        output = output_items(record.completion_id or "", choice.message, status, None, wire)
    return response_object(
        id=record.completion_id or "",
        created_at=record.created_at,
        model=model,
        status=status,
        output=output,
        wire=wire,
        params=record.params,
        tools=record.tools,
        usage_=usage(prompt or 0, completion or 0) if status != "failed" else None,
        error=error,
    )


def input_items(stored: StoredCall) -> list[dict[str, Any]]:
    """The items of a stored call's own input (not those a `previous_response_id` brought in),
    as `GET /v1/responses/{id}/input_items` lists them, in order, with ids."""
    record = stored.record
    wire = record.params.get("responses") or {}
    messages = record.request_messages[int(wire.get("input_start", 0)) :]
    prefix = (record.completion_id or "").removeprefix("resp_")
    items: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if role == "tool":
            items.append(
                {
                    "id": f"fco_{prefix}_{i}",
                    "type": "function_call_output",
                    "call_id": m.get("tool_call_id"),
                    "output": _plain_text(m.get("content")),
                    "status": "completed",
                }
            )
            continue
        text = _plain_text(m.get("content"))
        if role != "assistant" or text:
            kind = "output_text" if role == "assistant" else "input_text"
            items.append(
                {
                    "id": f"msg_{prefix}_{i}",
                    "type": "message",
                    "role": role,
                    "status": "completed",
                    "content": [{"type": kind, "text": text}],
                }
            )
        for call in m.get("tool_calls") or []:
            fn = call.get("function") or {}
            items.append(
                call_item(
                    call.get("id", ""),
                    fn.get("name", ""),
                    fn.get("arguments", ""),
                    "completed",
                    wire,
                )
            )
    return items


def _plain_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


# ----------------------------------------------------------------------------- streamed


@dataclass
class _Item:
    index: int
    item: dict[str, Any]
    text: str = ""
    logprobs: list[dict[str, Any]] = field(default_factory=list)


class Events:
    """The core's chunks of one answer as the Responses API's typed events, in OpenAI's order,
    each with its `type` and a `sequence_number` from 0:

        response.created, response.in_progress,
        per item: response.output_item.added,
            a message: response.content_part.added, response.output_text.delta...,
                response.output_text.done, response.content_part.done
            a call: response.function_call_arguments.delta..., ...arguments.done
        response.output_item.done,
        response.completed (or response.incomplete when max_output_tokens cut it, or
        response.failed after an error in the stream).
    """

    def __init__(
        self,
        response_id: str,
        model: str,
        chat: ChatCompletionRequest,
        wire: dict[str, Any],
        created_at: float,
    ) -> None:
        self.id = response_id
        self.model = model  # what serves the answer, named from the first event on
        self.chat = chat
        self.wire = wire
        self.created_at = created_at
        # The request's side of the `response` object, the same in all three it sends.
        self.params = chat.model_dump(exclude_none=True)
        self.tools = [t.model_dump(exclude_none=True) for t in chat.tools or []]
        self.seq = 0
        self.items: list[_Item] = []
        self.open: _Item | None = None
        self.calls: dict[int, _Item] = {}  # the core's tool call index -> its item
        self.usage: dict[str, Any] | None = None
        self.finish: str | None = None

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def _response(self, status: str, error: dict[str, Any] | None = None) -> dict[str, Any]:
        done = status not in ("in_progress",)
        output = [i.item for i in self.items] if done else []
        u = self.usage or {}
        return response_object(
            id=self.id,
            created_at=self.created_at,
            model=self.model,
            status=status,
            output=output,
            wire=self.wire,
            params=self.params,
            tools=self.tools,
            usage_=usage(u.get("prompt_tokens", 0), u.get("completion_tokens", 0))
            if done and status != "failed"
            else None,
            error=error,
        )

    async def run(self, chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
        yield self._event("response.created", response=self._response("in_progress"))
        yield self._event("response.in_progress", response=self._response("in_progress"))
        async for chunk in chunks:
            if "error" in chunk and "choices" not in chunk:
                for event in self._close():
                    yield event
                error = chunk["error"] or {}
                failure = {
                    "code": error.get("code") or "server_error",
                    "message": error.get("message", ""),
                }
                yield self._event("response.failed", response=self._response("failed", failure))
                return
            if chunk.get("usage"):
                self.usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                for event in self._choice(choice):
                    yield event
        for event in self._close():
            yield event
        status = status_of(self.finish)
        yield self._event(f"response.{status}", response=self._response(status))

    def _choice(self, choice: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        delta = choice.get("delta") or {}
        logprobs = (choice.get("logprobs") or {}).get("content") or []
        text = delta.get("content")
        if text or (logprobs and self.open is not None and self.open.item["type"] == "message"):
            if self.open is None or self.open.item["type"] != "message":
                events += self._close()
                events += self._open_message()
            item = self.open
            assert item is not None
            item.text += text or ""
            item.logprobs += logprobs
            events.append(
                self._event(
                    "response.output_text.delta",
                    item_id=item.item["id"],
                    output_index=item.index,
                    content_index=0,
                    delta=text or "",
                    logprobs=logprobs,
                )
            )
        for call in delta.get("tool_calls") or []:
            if call.get("id"):  # a new call: its id and name come first
                events += self._close()
                fn = call.get("function") or {}
                item = _Item(
                    len(self.items),
                    call_item(call["id"], fn.get("name", ""), "", "in_progress", self.wire),
                )
                self.items.append(item)
                self.open = self.calls[call.get("index", 0)] = item
                events.append(
                    self._event(
                        "response.output_item.added", output_index=item.index, item=dict(item.item)
                    )
                )
                fragment = fn.get("arguments") or ""
            else:
                item = self.calls[call.get("index", 0)]
                fragment = (call.get("function") or {}).get("arguments") or ""
            if fragment:
                item.text += fragment
                events.append(
                    self._event(
                        "response.function_call_arguments.delta",
                        item_id=item.item["id"],
                        output_index=item.index,
                        delta=fragment,
                    )
                )
        if choice.get("finish_reason"):
            self.finish = choice["finish_reason"]
            if not self.items:  # nothing at all was said: one empty message, as OpenAI does
                events += self._open_message()
        return events

    def _open_message(self) -> list[dict[str, Any]]:
        item = _Item(len(self.items), message_item(self.id, "", "in_progress"))
        item.item["content"] = []
        self.items.append(item)
        self.open = item
        return [
            self._event(
                "response.output_item.added", output_index=item.index, item=dict(item.item)
            ),
            self._event(
                "response.content_part.added",
                item_id=item.item["id"],
                output_index=item.index,
                content_index=0,
                part=output_text_part(""),
            ),
        ]

    def _close(self) -> list[dict[str, Any]]:
        """Finish the open item: its `.done` events, with its whole text or arguments."""
        item, self.open = self.open, None
        if item is None:
            return []
        status = status_of(self.finish) if self.finish else "completed"
        events = []
        if item.item["type"] == "message":
            part = output_text_part(item.text, item.logprobs)
            events.append(
                self._event(
                    "response.output_text.done",
                    item_id=item.item["id"],
                    output_index=item.index,
                    content_index=0,
                    text=item.text,
                    logprobs=item.logprobs,
                )
            )
            events.append(
                self._event(
                    "response.content_part.done",
                    item_id=item.item["id"],
                    output_index=item.index,
                    content_index=0,
                    part=part,
                )
            )
            item.item = {**item.item, "status": status, "content": [part]}
        else:
            item.item = {**item.item, "status": status, "arguments": item.text}
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item.item["id"],
                    output_index=item.index,
                    name=item.item["name"],
                    arguments=item.text,
                )
            )
        events.append(
            self._event("response.output_item.done", output_index=item.index, item=item.item)
        )
        return events


def not_found(response_id: str) -> APIError:
    return NotFoundError(f"Response with id '{response_id}' not found.", param="response_id")
