"""Validating a chat-completions request and turning it into what the engine needs.

`prepare_chat` raises every 4xx the chat route can give (a request too big in shape, unknown
model, invalid parameters, an over-long prompt, a schema or tool list that cannot become a
grammar) before any token is generated; what it returns, `PreparedChat`, holds the rendered
prompt ids, sampling parameters, grammar and the answer's budget (`proxy.chat.budget`, the one
place budgets are fitted to the context). `count_prompt_tokens` validates and renders the same
way and counts, whatever the prompt's length. No generation and no HTTP here.

The shape limits (`check_shape`) run first, before anything that costs in proportion to them:
messages, stop strings and tools are counted, and every schema (tool parameters,
response_format) is bounded in depth and, all together, in size. Both bound the work of the
grammar compiler, which runs on the event loop; a schema nested a few hundred deep would
otherwise exhaust Python's stack in it (a 500).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from proxy.adapters.registry import Resolved, ServedModels
from proxy.chat import grammar
from proxy.chat.budget import DEFAULT_RULE, BudgetRule, OutputBudget, prompt_too_long
from proxy.chat.grammar import ToolChoice, json_shape
from proxy.chat.prompt import ChatTemplate
from proxy.chat.record import CallInfo, RequestDump
from proxy.chat.tool_formats import HERMES, ToolFormat
from proxy.engines.base import SamplingParams
from proxy.errors import InvalidRequestError
from proxy.protocols.chat import ChatCompletionRequest
from storage.held_out import Arm

logger = logging.getLogger(__name__)

MAX_TOP_LOGPROBS = 20
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
MAX_STOP = 4  # OpenAI's limits
MAX_TOOLS = 128


@dataclass(frozen=True)
class RequestLimits:
    """Bounds on a request's shape (settings `max_messages`, `max_schema_depth`,
    `max_schema_nodes`)."""

    max_messages: int = 2048
    max_schema_depth: int = 32
    max_schema_nodes: int = 10_000


DEFAULT_LIMITS = RequestLimits()


@dataclass
class PreparedChat:
    """A validated request, ready for the engine."""

    call: CallInfo
    resolved: Resolved
    dumped: RequestDump
    """The request as plain JSON, dumped once; the call record stores this form."""
    parse_tools: bool
    prompt_ids: list[int]
    params: SamplingParams
    n: int
    grammar: grammar.Grammar | None
    include_usage: bool
    budget: OutputBudget
    """The answer's budget: what the client asked for and what the context leaves it."""
    held_out: Arm | None = None
    """Its task is held out of training (`storage.held_out`), and in which arm; None: it trains
    as usual. Set by `ChatService.prepare`."""

    @property
    def request(self) -> ChatCompletionRequest:
        return self.call.request

    @property
    def messages(self) -> list[dict[str, Any]]:
        return self.dumped.messages

    @property
    def tools(self) -> list[dict[str, Any]] | None:
        return self.dumped.tools

    @property
    def request_id(self) -> str:
        return self.call.request_id

    @property
    def id(self) -> str:
        return self.call.completion_id


def prepare_chat(
    call: CallInfo,
    *,
    registry: ServedModels,
    tokenizer: Any,
    max_context: int,
    max_n: int,
    budget: BudgetRule = DEFAULT_RULE,
    max_token_chars: int = 0,
    limits: RequestLimits = DEFAULT_LIMITS,
    template: ChatTemplate | None = None,
) -> PreparedChat:
    """Validate `call.request` (every 4xx the chat route can give); turn it into engine inputs.

    `template`: the model's chat template and tool-call family (read from `tokenizer` when not
    given; build it once per model, as `ChatService` does). `budget`: how the answer's budget is
    fitted to what the context leaves after the prompt (`proxy.chat.budget`)."""
    template = template or ChatTemplate.for_tokenizer(tokenizer)
    req = call.request
    rendered = render_chat(call, registry=registry, max_n=max_n, limits=limits, template=template)
    if max_token_chars and len(rendered.text) > max_context * max_token_chars:
        # No token spells more than `max_token_chars` characters, so this prompt cannot fit:
        # refuse it without tokenizing (megabytes of text take seconds to tokenize).
        raise prompt_too_long(len(rendered.text) // max_token_chars, max_context, at_least=True)
    prompt_ids = tokenizer.encode(rendered.text, add_special_tokens=False)
    output = budget.fit(len(prompt_ids), req.max_completion_tokens or req.max_tokens, max_context)
    params = SamplingParams(
        max_tokens=output.used,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        seed=req.seed,
        stop=req.stop_list,
        logprobs=bool(req.logprobs),
        top_logprobs=req.top_logprobs or 0,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
    )
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    return PreparedChat(
        call=call,
        resolved=rendered.resolved,
        dumped=rendered.dumped,
        parse_tools=rendered.parse_tools,
        prompt_ids=prompt_ids,
        params=params,
        n=req.n or 1,
        grammar=rendered.grammar,
        include_usage=include_usage,
        budget=output,
    )


def count_prompt_tokens(
    call: CallInfo,
    *,
    registry: ServedModels,
    tokenizer: Any,
    limits: RequestLimits = DEFAULT_LIMITS,
    template: ChatTemplate | None = None,
) -> int:
    """The prompt's length in tokens, validated and rendered as `prepare_chat` would, whatever
    its length: a prompt longer than the context is counted, not refused (Anthropic's
    `count_tokens`, which a client asks to learn whether to shorten its conversation)."""
    template = template or ChatTemplate.for_tokenizer(tokenizer)
    rendered = render_chat(call, registry=registry, max_n=1, limits=limits, template=template)
    return len(tokenizer.encode(rendered.text, add_special_tokens=False))


@dataclass
class RenderedChat:
    """A validated request's prompt text and what was read from the request to render it."""

    resolved: Resolved
    dumped: RequestDump
    parse_tools: bool
    grammar: grammar.Grammar | None
    text: str


def render_chat(
    call: CallInfo,
    *,
    registry: ServedModels,
    max_n: int,
    limits: RequestLimits,
    template: ChatTemplate,
) -> RenderedChat:
    """Validate `call.request` (every 4xx but the context's) and render its prompt text."""
    req = call.request
    dumped = check_shape(req, limits)
    resolved = registry.resolve(req.model, protocol=call.protocol)
    n = req.n or 1
    if n > max_n:
        raise InvalidRequestError(f"n={n} is above this server's limit of {max_n}.", param="n")
    if req.stream_options is not None and not req.stream:
        raise InvalidRequestError(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            param="stream_options",
        )
    if req.seed is not None and not SEED_MIN <= req.seed <= SEED_MAX:
        raise InvalidRequestError(
            f"Invalid 'seed': {req.seed} is outside the 64-bit signed integer range.",
            param="seed",
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
    tools = dumped.tools
    choice = tool_choice(req, tools)
    constraint = grammar_for(req, dumped, choice, template.tool_format)
    rendered_tools = tools if choice.kind != "none" else None
    try:
        text = template.render(dumped.messages, rendered_tools)
        text.encode("utf-8")  # a lone surrogate ("\ud800") is valid JSON but not text
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"The messages or tools contain a lone surrogate ({exc.object[exc.start]!r}), "
            "which is not valid Unicode text.",
            param="messages",
        ) from exc
    except ValueError as exc:
        raise InvalidRequestError(str(exc), param="messages") from exc
    return RenderedChat(
        resolved=resolved,
        dumped=dumped,
        parse_tools=choice.kind != "none",
        grammar=constraint,
        text=text,
    )


def check_shape(req: ChatCompletionRequest, limits: RequestLimits) -> RequestDump:
    """Refuse a request whose size alone is too much (400), before any work that grows with it;
    the request dumped once (after its lengths are known to be bounded), which every later step
    reads."""
    stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
    _at_most("messages", len(req.messages), limits.max_messages)
    _at_most("stop", len(stops), MAX_STOP)
    _at_most("tools", len(req.tools or []), MAX_TOOLS)
    dumped = RequestDump.of(req)
    schemas = [
        (f"tools[{i}].function.parameters", tool.function.parameters)
        for i, tool in enumerate(req.tools or [])
        if tool.function.parameters is not None
    ]
    fmt = req.response_format
    if fmt is not None and fmt.json_schema is not None and fmt.json_schema.schema_ is not None:
        schemas.append(("response_format.json_schema.schema", fmt.json_schema.schema_))
    # Every other parameter is stored as JSON: bound its nesting too (OpenAI's `metadata` is a
    # flat map; nothing rlproxy knows nests more than a few levels).
    params = {k: v for k, v in dumped.fields.items() if k != "response_format"}
    for param, value in params.items():
        depth, _ = json_shape(value)
        if depth > limits.max_schema_depth:
            raise InvalidRequestError(
                f"Invalid '{param}': objects and arrays are nested {depth} deep, above this "
                f"server's limit of {limits.max_schema_depth} (RLPROXY_MAX_SCHEMA_DEPTH).",
                param=param,
            )
    nodes = 0
    for param, schema in schemas:
        depth, size = json_shape(schema)
        if depth > limits.max_schema_depth:
            raise InvalidRequestError(
                f"Invalid schema for '{param}': objects and arrays are nested {depth} deep, "
                f"above this server's limit of {limits.max_schema_depth} "
                "(RLPROXY_MAX_SCHEMA_DEPTH).",
                param=param,
            )
        nodes += size
    if nodes > limits.max_schema_nodes:
        raise InvalidRequestError(
            f"The request's schemas (tool parameters and response_format) hold {nodes} JSON "
            f"values together, above this server's limit of {limits.max_schema_nodes} "
            "(RLPROXY_MAX_SCHEMA_NODES).",
            param="tools" if req.tools else "response_format",
        )
    return dumped


def _at_most(param: str, length: int, limit: int) -> None:
    if length > limit:
        raise InvalidRequestError(
            f"Invalid '{param}': array too long. Expected an array with maximum length {limit}, "
            f"but got an array with length {length} instead.",
            param=param,
            code="array_above_max_length",
        )


def tool_choice(req: ChatCompletionRequest, tools: list[dict[str, Any]] | None) -> ToolChoice:
    """The request's tool_choice, checked against its tools ("none" when there are none)."""
    choice = req.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise InvalidRequestError(
                "Invalid value for 'tool_choice': 'tool_choice' is only allowed when 'tools' "
                "are specified.",
                param="tool_choice",
            )
        return ToolChoice("none")
    if choice is None or isinstance(choice, str):
        return ToolChoice.of(choice)
    name = choice.function.get("name", "")
    if name not in {t["function"]["name"] for t in tools}:
        raise InvalidRequestError(
            f"Invalid value for 'tool_choice': no function named '{name}' was specified in "
            "the 'tools' parameter.",
            param="tool_choice",
        )
    return ToolChoice("function", name)


def grammar_for(
    req: ChatCompletionRequest,
    dumped: RequestDump,
    choice: ToolChoice,
    tool_format: ToolFormat = HERMES,
) -> grammar.Grammar | None:
    fmt, tools = req.response_format, dumped.tools
    constrains_tools = bool(tools) and choice.kind != "none"
    if (
        not constrains_tools
        and fmt is not None
        and fmt.type == "json_schema"
        and (fmt.json_schema is None or fmt.json_schema.schema_ is None)
    ):
        raise InvalidRequestError(
            "Missing required parameter: 'response_format.json_schema.schema'.",
            param="response_format.json_schema.schema",
            code="missing_required_parameter",
        )
    try:
        return grammar.constraint_for_request(
            dumped.fields.get("response_format"),
            tools,
            choice,
            parallel_tool_calls=req.parallel_tool_calls is not False,
            tool_format=tool_format,
        )
    except grammar.GrammarError as exc:
        param = "tools" if constrains_tools else "response_format"
        raise InvalidRequestError(str(exc), param=param) from exc
