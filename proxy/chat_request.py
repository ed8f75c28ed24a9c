"""Validating a chat-completions request and turning it into what the engine needs.

`prepare_chat` raises every 4xx the chat route can give (unknown model, invalid parameters, an
over-long prompt, a schema or tool list that cannot become a grammar) before any token is
generated; what it returns, `PreparedChat`, holds the rendered prompt ids, sampling parameters
and grammar. No generation and no HTTP here.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from proxy import chat_format, grammar
from proxy.engine.base import SamplingParams
from proxy.errors import ContextLengthError, InvalidRequestError
from proxy.protocol import ChatCompletionRequest, completion_id, now
from proxy.registry import Resolved, ServedModels

logger = logging.getLogger(__name__)

MAX_TOP_LOGPROBS = 20


@dataclass
class PreparedChat:
    """A validated request, ready for the engine."""

    request: ChatCompletionRequest
    request_id: str
    resolved: Resolved
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    parse_tools: bool
    prompt_ids: list[int]
    params: SamplingParams
    n: int
    grammar: grammar.Grammar | None
    include_usage: bool
    headers: dict[str, str] = field(default_factory=dict)
    created: int = field(default_factory=now)
    started: float = field(default_factory=time.monotonic)

    @property
    def id(self) -> str:
        return completion_id(self.request_id)


def prepare_chat(
    req: ChatCompletionRequest,
    request_id: str,
    headers: dict[str, str] | None,
    *,
    registry: ServedModels,
    tokenizer: Any,
    max_context: int,
    max_n: int,
    default_max_tokens: int,
) -> PreparedChat:
    """Validate `req` (every 4xx the chat route can give) and turn it into engine inputs."""
    if req.unknown_fields():
        logger.info("request %s: ignoring unknown fields %s", request_id, req.unknown_fields())
    resolved = registry.resolve(req.model)
    n = req.n or 1
    if n > max_n:
        raise InvalidRequestError(f"n={n} is above this server's limit of {max_n}.", param="n")
    if req.stream_options is not None and not req.stream:
        raise InvalidRequestError(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            param="stream_options",
        )
    top_logprobs = req.top_logprobs or 0
    if top_logprobs > MAX_TOP_LOGPROBS:
        raise InvalidRequestError(
            f"Invalid 'top_logprobs': integer above maximum value. Expected a value <= "
            f"{MAX_TOP_LOGPROBS}, but got {top_logprobs} instead.",
            param="top_logprobs",
            code="integer_above_max_value",
        )
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequestError(
            "Invalid value for 'top_logprobs': you must set 'logprobs' to true.",
            param="top_logprobs",
        )
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    mode = tool_mode(req, tools)
    constraint = grammar_for(req, tools, mode)
    rendered_tools = tools if mode != "none" else None
    try:
        prompt = chat_format.render_prompt(messages, rendered_tools)
    except ValueError as exc:
        raise InvalidRequestError(str(exc), param="messages") from exc
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    max_tokens = req.max_completion_tokens or req.max_tokens
    limit = max_context
    if len(prompt_ids) + (max_tokens or 1) > limit:
        raise ContextLengthError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{len(prompt_ids) + (max_tokens or 0)} tokens ({len(prompt_ids)} in the messages, "
            f"{max_tokens or 0} in the completion). Please reduce the length of the messages "
            "or completion.",
            param="messages",
        )
    budget = max_tokens or min(default_max_tokens, limit - len(prompt_ids))
    params = SamplingParams(
        max_tokens=budget,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        seed=req.seed,
        stop=req.stop_list,
        logprobs=bool(req.logprobs),
        top_logprobs=top_logprobs,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
    )
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return PreparedChat(
        request=req,
        request_id=request_id,
        resolved=resolved,
        messages=messages,
        tools=tools,
        parse_tools=mode != "none",
        prompt_ids=prompt_ids,
        params=params,
        n=n,
        grammar=constraint,
        include_usage=include_usage,
        headers=headers or {},
    )


def tool_mode(req: ChatCompletionRequest, tools: list[dict[str, Any]] | None) -> str:
    """'none', 'auto', 'required', or the name of the one tool that must be called."""
    choice = req.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise InvalidRequestError(
                "Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' "
                "are specified.",
                param="tool_choice",
            )
        return "none"
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        return choice
    name = choice.function.get("name", "")
    if name not in {t["function"]["name"] for t in tools}:
        raise InvalidRequestError(
            f"Invalid value for 'tool_choice': no function named '{name}' was specified in "
            "the 'tools' parameter.",
            param="tool_choice",
        )
    return name


def grammar_for(
    req: ChatCompletionRequest, tools: list[dict[str, Any]] | None, mode: str
) -> grammar.Grammar | None:
    try:
        if tools and mode != "none":
            choice: str | dict[str, Any] = mode
            if mode not in ("auto", "required"):
                choice = {"type": "function", "function": {"name": mode}}
            return grammar.constraint_for_tools(
                tools, choice, parallel_tool_calls=req.parallel_tool_calls is not False
            )
        fmt = req.response_format
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return grammar.constraint_for_json_object()
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise InvalidRequestError(
                "Missing required parameter: 'response_format.json_schema.schema'.",
                param="response_format.json_schema.schema",
                code="missing_required_parameter",
            )
        return grammar.constraint_for_json_schema(fmt.json_schema.schema_)
    except grammar.GrammarError as exc:
        param = "tools" if tools and mode != "none" else "response_format"
        raise InvalidRequestError(str(exc), param=param) from exc
