"""Anthropic's Messages API (`POST /v1/messages`) at the edge of the one chat core.

    chat = to_chat(request)                        # blocks -> the core's chat request
    body = render(message_id, request, core, ...)  # the core's body -> a `message`
    async for event in Events(...).run(chunks)     # the core's chunks -> Anthropic's events

`system` (a string or text blocks) becomes the first message; a `role: "system"` message inside
`messages` (Claude Code sends one: environment, skills, date) stays a system message at its place
in the conversation. Content blocks map to the core's messages: `text` to text, `image` (base64
or URL) to an image part, `tool_use` to an assistant's tool call (its `input` object as JSON
arguments), `tool_result` to a tool message (the tool results of a user turn come first, in
order, then its text). Tools are `{name, description, input_schema}`; `tool_choice`
`auto`/`any`/`tool`/`none` is the core's `auto`/`required`/named/`none`, and
`disable_parallel_tool_use` its `parallel_tool_calls: false`. `stop_sequences`,
`max_tokens`, `temperature`, `top_p` and `top_k` are the core's sampling parameters (the
anthropic SDK 2.x sends the last three only through `extra_body`); `output_config.format` (a
JSON schema) is the core's structured output.

Stop reasons: `tool_use` when the answer calls a tool, `max_tokens` when the budget cut it,
`model_context_window_exceeded` when the context's end cut it (a `max_tokens` that did not fit
what the prompt left was shortened, `proxy.chat.budget`), `stop_sequence` (with the one matched)
when a stop sequence ended it, else `end_turn`. A prompt the context cannot hold is Anthropic's
400 "prompt is too long: N tokens > M maximum" (`context_error`).

Errors on these routes are Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`
(`anthropic_error`, applied to every error of the path by `proxy.api.app`).

`thinking` blocks of earlier assistant turns are kept: their text is the turn's
`reasoning_content`, stored with it (the signature, a check of that text for Anthropic's servers,
is not). `cache_control` on any block is served by the engines' automatic prefix cache, which
keeps every prompt's prefix without breakpoints. What has no effect here is named by
`ignored_fields` (the route's `X-RLProxy-Ignored-Fields`): the `thinking` parameter (unless
disabled) and `output_config.effort` (this server's models do not think aloud),
`context_management` (the conversation is served as sent), a tool's `defer_loading` (every tool is
offered), `redacted_thinking` blocks (encrypted: nothing to keep) and unknown fields.

Not supported (a 400 that says so): server tools (web search, code execution, ...), `document`
and `search_result` blocks, `container` and `mcp_servers`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, StrictFloat, StrictInt, ValidationError

from proxy.errors import ContextLengthError, InvalidRequestError, longer_context
from proxy.protocols.chat import (
    ChatCompletionRequest,
    OpenAIModel,
    field_paths,
    plain,
    plain_names,
)

_NOT_SUPPORTED = {
    "container": "Containers are not supported by this server.",
    "mcp_servers": "MCP servers are not supported by this server; give the model tools instead.",
}
_HONOURED = frozenset({"cache_control", *_NOT_SUPPORTED})
"""Top-level fields that are not declared below and not ignored: `cache_control` (the prefix
cache serves it) and the refused ones (a 400 before any answer)."""
_TOOL_FIELDS = frozenset({"type", "name", "description", "input_schema", "cache_control", "strict"})
"""A custom tool's fields that are honoured (`strict`: tool input is always held to its schema by
the grammar)."""


class MessageParam(OpenAIModel):
    # "system": not in Anthropic's published list; Claude Code sends one inside `messages`
    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]


class ToolChoice(OpenAIModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class OutputFormat(OpenAIModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(OpenAIModel):
    format: OutputFormat | None = None
    effort: str | None = None  # no effect: this server's models do not think aloud


class MessagesRequest(OpenAIModel):
    """`POST /v1/messages`, as https://docs.anthropic.com/en/api/messages lists it."""

    model: str
    max_tokens: StrictInt = Field(ge=1)
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    temperature: StrictFloat | None = Field(None, ge=0.0, le=1.0)
    top_p: StrictFloat | None = Field(None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    output_config: OutputConfig | None = None
    service_tier: str | None = None
    # rlproxy extension: {"trajectory_id": ..., "group_id": ...}
    rlproxy: dict[str, Any] | None = None


class CountTokensRequest(OpenAIModel):
    """`POST /v1/messages/count_tokens`: a message request without `max_tokens`."""

    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None


# ----------------------------------------------------------------------------- in


def ignored_fields(req: MessagesRequest) -> tuple[str, ...]:
    """The fields of `req` that are accepted and have no effect here, by path, never by value
    (the module docstring says why each)."""
    named = plain_names(req, honoured=_HONOURED)
    if req.thinking is not None and req.thinking.get("type") != "disabled":
        named.append("thinking")
    if req.output_config is not None:
        if req.output_config.effort is not None:
            named.append("output_config.effort")
        named += plain_names(req.output_config, "output_config.")
    for tool in req.tools or []:
        if isinstance(tool, dict):
            named += [f"tools.{k}" for k in tool if k not in _TOOL_FIELDS and plain(k)]
    for message in req.messages:
        if isinstance(message.content, list) and any(
            isinstance(b, dict) and b.get("type") == "redacted_thinking" for b in message.content
        ):
            named.append("messages.content.redacted_thinking")
    return field_paths(named)


def to_chat(
    req: MessagesRequest | CountTokensRequest, *, stream: bool = False
) -> ChatCompletionRequest:
    """The core's chat request for `req`. Raises `InvalidRequestError` (400)."""
    for name, why in _NOT_SUPPORTED.items():
        if (req.model_extra or {}).get(name):
            raise InvalidRequestError(why, param=name, code="unsupported_parameter")
    messages: list[dict[str, Any]] = []
    if req.system:
        messages.append({"role": "system", "content": _system_text(req.system)})
    for i, message in enumerate(req.messages):
        messages.extend(_chat_messages(message, f"messages[{i}]"))
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "tools": [_chat_tool(t, i) for i, t in enumerate(req.tools)] if req.tools else None,
        "stream": stream or None,
        "stream_options": {"include_usage": True} if stream else None,
    }
    if req.tool_choice is not None:
        body["tool_choice"] = _chat_tool_choice(req.tool_choice)
        if req.tool_choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    if isinstance(req, MessagesRequest):
        body.update(
            max_tokens=req.max_tokens,
            stop=req.stop_sequences or None,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            user=(req.metadata or {}).get("user_id"),
            response_format=_response_format(req.output_config),
            metadata=req.metadata,
            rlproxy=req.rlproxy,
        )
    try:
        return ChatCompletionRequest.model_validate(
            {k: v for k, v in body.items() if v is not None}
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise InvalidRequestError(
            f"Invalid request: {first.get('msg', 'invalid')} (at {where}).", param="messages"
        ) from exc


def _response_format(config: OutputConfig | None) -> dict[str, Any] | None:
    if config is None or config.format is None:
        return None
    return {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": config.format.schema_},
    }


def _system_text(system: str | list[dict[str, Any]], where: str = "system") -> str:
    if isinstance(system, str):
        return system
    texts = []
    for i, block in enumerate(system):
        if not isinstance(block, dict) or block.get("type") != "text":
            raise InvalidRequestError(
                f"{where}.{i}: only text blocks are allowed in a system prompt.",
                param=f"{where}.{i}",
            )
        texts.append(_text(block, f"{where}.{i}"))
    return "\n\n".join(texts)


def _text(block: dict[str, Any], where: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise InvalidRequestError(
            f"{where}.text: Field required (a string).", param=f"{where}.text"
        )
    return text


def _chat_messages(message: MessageParam, where: str) -> list[dict[str, Any]]:
    if message.role == "system":  # at its place: folded into `system`, it would change the
        # prompt of every earlier turn, and the turns would no longer link by prefix
        return [{"role": "system", "content": _system_text(message.content, f"{where}.content")}]
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    texts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    thoughts: list[str] = []
    for j, block in enumerate(message.content):
        at = f"{where}.content.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append({"type": "text", "text": _text(block, at)})
        elif kind == "image" and message.role == "user":
            texts.append({"type": "image_url", "image_url": {"url": _image_url(block, at)}})
        elif kind == "tool_use" and message.role == "assistant":
            name, call_id = block.get("name"), block.get("id")
            if not isinstance(name, str) or not isinstance(call_id, str):
                raise InvalidRequestError(f"{at}: tool_use needs 'id' and 'name'.", param=at)
            arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
            calls.append(
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }
            )
        elif kind == "tool_result" and message.role == "user":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str):
                raise InvalidRequestError(
                    f"{at}.tool_use_id: Field required.", param=f"{at}.tool_use_id"
                )
            content = _result_text(block.get("content"), at)
            if block.get("is_error"):
                content = f"Error: {content}"
            results.append({"role": "tool", "tool_call_id": call_id, "content": content})
        elif kind == "thinking" and message.role == "assistant":
            thought = block.get("thinking")
            if isinstance(thought, str) and thought:
                thoughts.append(thought)
        elif kind in ("thinking", "redacted_thinking"):
            continue  # encrypted (named by `ignored_fields`), or not an assistant's
        else:
            raise InvalidRequestError(
                f"{at}: content blocks of type {kind!r} are not supported in a {message.role} "
                "message by this server (it takes text, image, tool_use and tool_result).",
                param=f"{at}.type",
            )
    if message.role == "assistant":
        text = "".join(t.get("text", "") for t in texts)
        answer: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            answer.update(content=text or None, tool_calls=calls)
        if thoughts:
            answer["reasoning_content"] = "\n\n".join(thoughts)
        return [answer]
    if texts:
        all_text = all(t["type"] == "text" for t in texts)
        user = "".join(t["text"] for t in texts) if all_text and len(texts) == 1 else texts
        return [*results, {"role": "user", "content": user}]
    return results


def _image_url(block: dict[str, Any], at: str) -> str:
    source = block.get("source") or {}
    if source.get("type") == "base64":
        return f"data:{source.get('media_type', 'image/png')};base64,{source.get('data', '')}"
    if source.get("type") == "url" and isinstance(source.get("url"), str):
        return str(source["url"])
    raise InvalidRequestError(
        f"{at}.source: expected a base64 or url source.", param=f"{at}.source"
    )


def _result_text(content: Any, at: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for k, block in enumerate(content):
            if not isinstance(block, dict) or block.get("type") != "text":
                raise InvalidRequestError(
                    f"{at}.content.{k}: this server takes text blocks in a tool_result.",
                    param=f"{at}.content.{k}",
                )
            texts.append(_text(block, f"{at}.content.{k}"))
        return "".join(texts)
    raise InvalidRequestError(
        f"{at}.content: expected a string or text blocks.", param=f"{at}.content"
    )


def _chat_tool(tool: Any, i: int) -> dict[str, Any]:
    where = f"tools.{i}"
    if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise InvalidRequestError(
            f"{where}: tools of type {kind!r} are not supported by this server; it serves "
            "custom tools ({'name': ..., 'input_schema': ...}).",
            param=f"{where}.type",
        )
    name, schema = tool.get("name"), tool.get("input_schema")
    if not isinstance(name, str):
        raise InvalidRequestError(f"{where}.name: Field required.", param=f"{where}.name")
    if not isinstance(schema, dict):
        raise InvalidRequestError(
            f"{where}.input_schema: Field required (a JSON schema object).",
            param=f"{where}.input_schema",
        )
    function: dict[str, Any] = {"name": name, "parameters": schema}
    if isinstance(tool.get("description"), str):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: ToolChoice) -> Any:
    if choice.type == "tool":
        if not choice.name:
            raise InvalidRequestError("tool_choice.name: Field required.", param="tool_choice.name")
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


# ----------------------------------------------------------------------------- out


def stop_reason(
    finish_reason: str | None, stop: str | None, made_calls: bool, shortened: bool = False
) -> str:
    """`shortened`: the request's `max_tokens` did not fit the context and was cut to what the
    prompt left, so a cut answer ran into the context's end, not into `max_tokens`."""
    if made_calls:
        return "tool_use"
    if finish_reason == "length":
        return "model_context_window_exceeded" if shortened else "max_tokens"
    if stop is not None:
        return "stop_sequence"
    return "end_turn"


def usage(input_tokens: int, output_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": output_tokens,
        "service_tier": "standard",
    }


def _tool_use(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function") or {}
    return {"type": "tool_use", "id": call["id"], "name": fn.get("name", ""), "input": _input(fn)}


def _input(fn: dict[str, Any]) -> Any:
    """A call's arguments as the object Anthropic's `input` is (the grammar makes them JSON;
    an upstream model's malformed arguments are kept as a string rather than lost)."""
    try:
        value = json.loads(fn.get("arguments") or "{}")
    except ValueError:
        return {"_raw": fn.get("arguments")}
    return value if isinstance(value, dict) else {"value": value}


def render(
    message_id: str,
    model: str,
    core: dict[str, Any],
    stop: str | None,
    shortened: bool = False,
) -> dict[str, Any]:
    """The `message` for a non-streamed answer of the core (`shortened`: see `stop_reason`)."""
    choice = core["choices"][0]
    message = choice["message"]
    calls = message.get("tool_calls") or []
    content: list[dict[str, Any]] = []
    if message.get("content") or not calls:
        content.append({"type": "text", "text": message.get("content") or ""})
    content += [_tool_use(c) for c in calls]
    u = core.get("usage") or {}
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason(choice.get("finish_reason"), stop, bool(calls), shortened),
        "stop_sequence": stop,
        "usage": usage(u.get("prompt_tokens", 0), u.get("completion_tokens", 0)),
    }


@dataclass
class _Block:
    index: int
    kind: str  # "text" | "tool_use"


class Events:
    """The core's chunks of one answer as Anthropic's stream, in its order:

        message_start, ping,
        per block: content_block_start, content_block_delta (text_delta or
            input_json_delta)..., content_block_stop
        message_delta (stop_reason, stop_sequence, usage), message_stop

    An error after the stream started is an `error` event, last.
    """

    def __init__(
        self, message_id: str, model: str, input_tokens: int, stop: Any, shortened: bool = False
    ) -> None:
        self.id = message_id
        self.shortened = shortened
        self.model = model
        self.input_tokens = input_tokens
        self.stopped_by = stop  # a callable: the stop string that ended the answer, if any
        self.blocks: list[_Block] = []
        self.open: _Block | None = None
        self.calls: dict[int, _Block] = {}
        self.finish: str | None = None
        self.output_tokens = 0

    async def run(self, chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
        yield {
            "type": "message_start",
            "message": {
                "id": self.id,
                "type": "message",
                "role": "assistant",
                "model": self.model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": usage(self.input_tokens, 0),
            },
        }
        yield {"type": "ping"}
        async for chunk in chunks:
            if "error" in chunk and "choices" not in chunk:
                error = chunk["error"] or {}
                yield {
                    "type": "error",
                    "error": {"type": "api_error", "message": error.get("message", "")},
                }
                return
            if chunk.get("usage"):
                self.output_tokens = chunk["usage"].get("completion_tokens", 0)
                self.input_tokens = chunk["usage"].get("prompt_tokens", self.input_tokens)
            for choice in chunk.get("choices") or []:
                for event in self._choice(choice):
                    yield event
        if not self.blocks:  # nothing was said: one empty text block, as Anthropic does
            for event in self._start("text", {"type": "text", "text": ""}):
                yield event
        for event in self._stop():
            yield event
        stop = self.stopped_by()
        yield {
            "type": "message_delta",
            "delta": {
                "stop_reason": stop_reason(self.finish, stop, bool(self.calls), self.shortened),
                "stop_sequence": stop,
            },
            "usage": usage(self.input_tokens, self.output_tokens),
        }
        yield {"type": "message_stop"}

    def _choice(self, choice: dict[str, Any]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        delta = choice.get("delta") or {}
        text = delta.get("content")
        if text:
            if self.open is None or self.open.kind != "text":
                events += self._start("text", {"type": "text", "text": ""})
            assert self.open is not None
            events.append(
                {
                    "type": "content_block_delta",
                    "index": self.open.index,
                    "delta": {"type": "text_delta", "text": text},
                }
            )
        for call in delta.get("tool_calls") or []:
            fn = call.get("function") or {}
            if call.get("id"):
                block = {
                    "type": "tool_use",
                    "id": call["id"],
                    "name": fn.get("name", ""),
                    "input": {},
                }
                events += self._start("tool_use", block)
                assert self.open is not None
                self.calls[call.get("index", 0)] = self.open
            fragment = fn.get("arguments") or ""
            if fragment:
                events.append(
                    {
                        "type": "content_block_delta",
                        "index": self.calls[call.get("index", 0)].index,
                        "delta": {"type": "input_json_delta", "partial_json": fragment},
                    }
                )
        if choice.get("finish_reason"):
            self.finish = choice["finish_reason"]
        return events

    def _start(self, kind: str, block: dict[str, Any]) -> list[dict[str, Any]]:
        events = self._stop()
        self.open = _Block(len(self.blocks), kind)
        self.blocks.append(self.open)
        events.append(
            {"type": "content_block_start", "index": self.open.index, "content_block": block}
        )
        return events

    def _stop(self) -> list[dict[str, Any]]:
        block, self.open = self.open, None
        return [] if block is None else [{"type": "content_block_stop", "index": block.index}]


def context_error(exc: ContextLengthError) -> InvalidRequestError:
    """A context refusal in Anthropic's words, which its clients read (Claude Code compacts its
    conversation on "prompt is too long"), with this server's advice."""
    p, c = exc.prompt_tokens, exc.max_context
    if exc.requested is not None:  # RLPROXY_OUTPUT_BUDGET=strict
        message = (
            f"input length and `max_tokens` exceed context limit: {p} + {exc.requested} > {c}, "
            "decrease input length or `max_tokens` and try again"
        )
    else:
        count = f"more than {p}" if exc.at_least else str(p)
        message = (
            f"prompt is too long: {count} tokens > {c - 1} maximum (this model's context is "
            f"{c} tokens, and the answer needs one at least); shorten the conversation, or "
            f"{longer_context(c)}"
        )
    return InvalidRequestError(message, param=exc.param, code=exc.code)


ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_error(
    status: int, openai_body: dict[str, Any], request_id: str | None
) -> dict[str, Any]:
    """An error of this server's (OpenAI's shape) in Anthropic's shape, for the same status."""
    error = openai_body.get("error") if isinstance(openai_body, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    body: dict[str, Any] = {
        "type": "error",
        "error": {"type": kind, "message": message or "The request failed."},
    }
    if request_id:
        body["request_id"] = request_id
    return body
