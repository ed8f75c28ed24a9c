"""Constrained decoding with llguidance: one grammar matcher per batch row.

What it is: factories that turn a request's `response_format` / `tools` + `tool_choice` into a
`Grammar` (validated, immutable, shareable by all rows and samples of a request), and the
`RowConstraint` the engine's decode loop drives for one row:

    grammar = constraint_for_tools(tools, ToolChoice("required"))  # None = unconstrained
    row = grammar.new_row(info)                         # per batch row (info: the engine's)
    each step:  row.fill_bitmask(bitmask, i)            # for each constrained row i
                (the engine masks the logits, samples)
                row.consume(token); if row.is_stopped(): finish the row ("stop")

What it is not: it does not sample, batch, tokenize prompts or mask logits (llguidance's view of
the tokenizer, the bitmask and applying it are the engine's: `proxy.engines.token_mask`), and it
knows nothing of HTTP. Errors in a request's schema raise `GrammarError` (a ValueError: the
server answers 400).

Why llguidance (see DESIGN.md, "Engine facts"): per-row matchers, "free text or a tool call" in
one grammar, sub-millisecond compiles, one small wheel with no dependencies.

Grammars (llguidance's Lark dialect; `%json {...}` inlines a JSON schema). JSON is generated
without free whitespace, with `, ` and `: ` separators (the layout of Python's `json.dumps`), so
that a 135M model cannot loop on whitespace and its output looks like the prompts' histories:

- json_object: any JSON object. json_schema: JSON valid against the schema.
- tools, "required": `call ("\\n" call)*` (just `call` if parallel_tool_calls is false), where
  `call` is `<tool_call>{"name": "<one of the tools>", "arguments": <args valid for that tool's
  parameters>}</tool_call>`; then the grammar ends.
- tools, named (`{"type": "function", "function": {"name": N}}`): exactly one call of N.
- tools, "auto": free text, or free text followed by calls as above. The text before a call is a
  lazy lexeme that ends at the first `<tool_call>` (llguidance's tool-calling pattern), so once
  the model writes the tag the call must be valid: a malformed call cannot be produced.

Those are the Hermes family's tool grammars. The Llama 3.1 JSON family (`tool_format`
`llama3_json`, see `proxy.chat.tool_formats`) has the same three, with `call` being
`{"name": "<tool>", "parameters": <args>}` joined by `; ` and no text around the calls; in "auto"
the answer is either the calls or text whose first character is neither `{` nor a blank (so text
can never be read as a call). It writes one call per answer whatever `parallel_tool_calls` says:
Meta's templates refuse a history turn with several (the parser still reads `;`-joined calls).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import llguidance
import torch
from llguidance import LLMatcher

from proxy.chat.prompt import ChatFormatError, normalize_tool, tool_parameters
from proxy.chat.tool_formats import HERMES, ToolFormat
from proxy.chat.tool_parser import CLOSE_TAG, OPEN_TAG
from proxy.engines.token_mask import GrammarError

# JSON layout inside every grammar: no free whitespace, json.dumps separators.
JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


# How deeply a JSON schema may nest (objects and arrays). llguidance refuses schemas a little
# shallower than this anyway (serde_json's recursion limit of 128 counts its own wrapping too);
# checking first, without recursion, keeps the recursive walks below from exhausting Python's
# stack on a hostile schema hundreds of levels deep (a RecursionError: a 500, not a 400).
MAX_SCHEMA_DEPTH = 128


@dataclass(frozen=True)
class ToolChoice:
    """A request's `tool_choice`, typed: `kind` says what is allowed, `name` which tool must be
    called when the kind is "function" (so a tool named "auto" is never read as the mode)."""

    kind: Literal["none", "auto", "required", "function"]
    name: str | None = None

    @classmethod
    def of(cls, value: str | Mapping[str, Any] | None) -> ToolChoice:
        """From the wire form: "none" | "auto" | "required" | {"type": "function", ...}; None
        is OpenAI's default when tools are given, "auto"."""
        if value is None:
            return cls("auto")
        if isinstance(value, Mapping):
            fn = value.get("function") if value.get("type") == "function" else None
            name = fn.get("name") if isinstance(fn, Mapping) else None
            if not isinstance(name, str):
                raise GrammarError(
                    'tool_choice must be "none", "auto", "required" or '
                    '{"type": "function", "function": {"name": ...}}'
                )
            return cls("function", name)
        if value in ("none", "auto", "required"):
            return cls(value)  # type: ignore[arg-type]
        raise GrammarError(f"tool_choice {value!r} is not supported")


_LIMIT_MARKS = ("too many",)
"""How llguidance's errors say it ran past its own limits (not that the token was wrong)."""


class TokenRejectedError(RuntimeError):
    """The engine fed a token the grammar does not allow: a bug in applying the bitmask."""


@dataclass(frozen=True)
class Grammar:
    """A validated llguidance grammar; immutable, shared by every row that uses it.

    `source` is llguidance's serialized grammar; `kind` says what it constrains (for logs).
    """

    source: str
    kind: str
    # Tool grammars: end the row when a call repeats an earlier one of the same output (the
    # small model tends to loop on `required`); the parser drops the repeat.
    stop_on_repeated_call: bool = False

    def new_row(self, info: llguidance.LLTokenizer) -> RowConstraint:
        return RowConstraint(info, self)


class RowConstraint:
    """The grammar state of one batch row: computes its token mask, advances on each token."""

    def __init__(self, info: llguidance.LLTokenizer, grammar: Grammar) -> None:
        self.grammar = grammar
        # log_level 0: rejections surface as TokenRejectedError, not as stderr warnings.
        self.matcher = LLMatcher(info, grammar.source, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(f"{grammar.kind}: {self.matcher.get_error()}")
        self._info = info
        self._text = b""  # output so far, only kept when repeated calls stop the row
        self._calls: set[bytes] = set()
        self._repeated = False

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write this row's allowed tokens into `bitmask[row]` (bitmask: CPU int32, contiguous).

        A grammar that validates but cannot be followed (llguidance's parser limits: a schema
        that refers to itself forever, a regex that explodes) raises `GrammarError`: it is the
        request's input, so it fails alone with a 400."""
        words = bitmask[row]
        if bitmask.dtype != torch.int32 or not bitmask.is_cpu or not words.is_contiguous():
            raise ValueError("the bitmask must be a contiguous int32 tensor on the CPU")
        try:
            # The matcher writes the row's words in place. llguidance.torch's helper does the
            # same, but importing it compiles a kernel with torch.compile: seconds at each start.
            self.matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
        except Exception as exc:
            raise GrammarError(
                f"{self.grammar.kind}: the schema is too complex to follow while generating ({exc})"
            ) from exc

    def consume(self, token_id: int) -> None:
        """Advance past the sampled token; raises TokenRejectedError if the grammar forbids it."""
        if not self.matcher.consume_token(token_id):
            error = self.matcher.get_error()
            first = error.splitlines()[0].lower() if error else ""
            if any(mark in first for mark in _LIMIT_MARKS):
                # Not this token's fault: the parser ran past llguidance's limits on this
                # grammar (the request's input), so the request fails alone with a 400.
                raise GrammarError(
                    f"{self.grammar.kind}: the schema is too complex to follow while generating "
                    f"({first})"
                )
            raise TokenRejectedError(f"{self.grammar.kind}: token {token_id} rejected: {error}")
        if self.grammar.stop_on_repeated_call:
            self._track_calls(token_id)

    def _track_calls(self, token_id: int) -> None:
        self._text += self._info.decode_bytes([token_id])
        close = CLOSE_TAG.encode()
        if not self._text.endswith(close):
            return
        start = self._text.rfind(OPEN_TAG.encode())
        call = self._text[start:]
        if call in self._calls:
            self._repeated = True
        self._calls.add(call)

    def is_stopped(self) -> bool:
        """The grammar is complete and allows nothing but EOS: end the row (finish_reason stop).

        Also true once a tool call repeats an earlier one of this output.
        """
        return self._repeated or self.matcher.is_stopped()

    def is_accepting(self) -> bool:
        """The output so far is a complete match (EOS is allowed now)."""
        return self.matcher.is_accepting()


# -- factories --


def _validated(source: str, kind: str) -> Grammar:
    error = LLMatcher.validate_grammar(source)
    if error:
        raise GrammarError(f"{kind}: {error}")
    return Grammar(source, kind)


def json_shape(value: Any) -> tuple[int, int]:
    """(deepest nesting of objects and arrays, number of JSON values) of a parsed JSON value.

    Iterative: a value nested thousands deep must not exhaust Python's stack here too.
    `{"type": "string"}` is (1, 2); `[]` is (1, 1); `5` is (0, 1).
    """
    deepest, count = 0, 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        count += 1
        if isinstance(item, Mapping):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest, count


def _check_depth(schema: Any, kind: str) -> None:
    """Raise GrammarError if `schema` nests deeper than MAX_SCHEMA_DEPTH."""
    if json_shape(schema)[0] > MAX_SCHEMA_DEPTH:
        raise GrammarError(f"{kind}: the schema nests deeper than {MAX_SCHEMA_DEPTH} levels")


def _closed_objects(schema: Any) -> Any:
    """A copy of `schema` where objects that list `properties` but say nothing about
    `additionalProperties` allow no others (what OpenAI's strict mode requires). Output stays
    valid under the original schema; the small model otherwise invents keys without end."""
    if isinstance(schema, list):
        return [_closed_objects(s) for s in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = {k: _closed_objects(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _with_json_options(schema: Mapping[str, Any]) -> dict[str, Any]:
    # The schema's own "x-guidance" options, if any, win over ours.
    out = dict(_closed_objects(schema))
    out["x-guidance"] = {**JSON_OPTIONS, **dict(schema.get("x-guidance") or {})}
    return out


def constraint_for_json_object() -> Grammar:
    """response_format {"type": "json_object"}: any JSON object."""
    return constraint_for_json_schema({"type": "object"}, kind="json_object")


def constraint_for_json_schema(schema: Mapping[str, Any], kind: str = "json_schema") -> Grammar:
    """response_format {"type": "json_schema"}: JSON valid against `schema`."""
    if not isinstance(schema, Mapping):
        raise GrammarError(f"{kind}: the schema must be a JSON object")
    _check_depth(schema, kind)
    try:
        source = LLMatcher.grammar_from_json_schema(json.dumps(_with_json_options(schema)))
    except (ValueError, TypeError) as e:
        raise GrammarError(f"{kind}: invalid JSON schema: {e}") from e
    return _validated(source, kind)


def _lark_str(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def constraint_for_tools(
    tools: Sequence[Mapping[str, Any]] | None,
    choice: ToolChoice,
    parallel_tool_calls: bool = True,
    tool_format: ToolFormat = HERMES,
) -> Grammar | None:
    """The grammar for `choice` over `tools` in the model's tool-call family; None when nothing
    is constrained (no tools, or "none")."""
    if not tools or choice.kind == "none":
        return None
    try:
        normalized = [normalize_tool(t, i) for i, t in enumerate(tools)]
        params = {n["function"]["name"]: tool_parameters(n) for n in normalized}
    except ChatFormatError as e:
        raise GrammarError(str(e)) from e
    if len(params) != len(normalized):
        raise GrammarError("tools: two tools have the same name")
    for i, (name, parameters) in enumerate(params.items()):
        # Checked one by one so that an error names the tool, not the generated grammar.
        constraint_for_json_schema(parameters, kind=f"tools[{i}] ({name}) parameters")

    if choice.kind == "function":
        name = choice.name or ""
        if name not in params:
            raise GrammarError(f"tool_choice names {name!r}, which is not among the tools")
        names, kind, parallel = [name], f"tool_choice {name}", False
    else:
        names, kind, parallel = list(params), f"tool_choice {choice.kind}", parallel_tool_calls

    schemas = [json.dumps(_with_json_options(params[name]), ensure_ascii=False) for name in names]
    if tool_format.name == "llama3_json":
        # One call per answer: Meta's Llama 3.1-3.3 templates refuse a history turn that holds
        # several ("This model only supports single tool-calls at once!"), so a second call
        # would make the client's next request fail.
        lark = _llama3_lark(names, schemas, choice.kind == "auto", parallel=False)
    else:
        lark = _hermes_lark(names, schemas, choice.kind == "auto", parallel)
    grammar = _validated(LLMatcher.grammar_from_lark(lark), kind)
    # Hermes calls end with a tag the row can watch for repeats (Llama 3.1: one call anyway).
    repeats = parallel and tool_format.name == "hermes"
    return Grammar(grammar.source, grammar.kind, stop_on_repeated_call=repeats)


def _hermes_lark(names: list[str], schemas: list[str], auto: bool, parallel: bool) -> str:
    """`<tool_call>{"name": N, "arguments": ARGS}</tool_call>`, calls joined by newlines; in
    "auto", free text first, ended by the lazy `head` lexeme at the first `<tool_call>`."""
    bodies = []
    for i, (name, schema) in enumerate(zip(names, schemas, strict=True)):
        head = '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "arguments": '
        bodies.append(f'body_{i}: {_lark_str(head)} %json {schema} "}}</tool_call>"')
    more = ' ("\\n" call)*' if parallel else ""
    start = f"start: TEXT | head call_body{more}" if auto else f"start: call{more}"
    return "\n".join(
        [
            "%llguidance {}",
            start,
            # Free text; the lazy `head` lexeme ends it at the first "<tool_call>".
            "TEXT: /(?s:.*)/",
            'head[lazy]: TEXT "<tool_call>"',
            'call: "<tool_call>" call_body',
            "call_body: " + " | ".join(f"body_{i}" for i in range(len(names))),
            *bodies,
        ]
    )


def _llama3_lark(names: list[str], schemas: list[str], auto: bool, parallel: bool) -> str:
    """`{"name": N, "parameters": ARGS}`, calls joined by `; `, as the whole answer; in "auto",
    either that or text that does not start with `{` or a blank (so it cannot be a call)."""
    bodies = []
    for i, (name, schema) in enumerate(zip(names, schemas, strict=True)):
        head = '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "parameters": '
        bodies.append(f'body_{i}: {_lark_str(head)} %json {schema} "}}"')
    more = ' ("; " call)*' if parallel else ""
    start = f"start: calls | TEXT | {_lark_str('')}" if auto else "start: calls"
    return "\n".join(
        [
            "%llguidance {}",
            start,
            "TEXT: /[^{ \\t\\r\\n](?s:.*)/",
            f"calls: call{more}",
            "call: " + " | ".join(f"body_{i}" for i in range(len(names))),
            *bodies,
        ]
    )


def constraint_for_request(
    response_format: Mapping[str, Any] | None,
    tools: Sequence[Mapping[str, Any]] | None,
    tool_choice: ToolChoice | None,
    parallel_tool_calls: bool | None = None,
    tool_format: ToolFormat = HERMES,
) -> Grammar | None:
    """The grammar for a chat completion request's fields, or None for free generation.

    Tools win over response_format when both are active: a tool call cannot also be the
    response's JSON. tool_choice defaults to "auto" when tools are given (OpenAI's default).
    """
    choice = tool_choice or ToolChoice("auto")
    if tools and choice.kind != "none":
        parallel = True if parallel_tool_calls is None else parallel_tool_calls
        return constraint_for_tools(tools, choice, parallel, tool_format)
    if not response_format:
        return None
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return constraint_for_json_object()
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, Mapping) or not isinstance(spec.get("schema", {}), Mapping):
            raise GrammarError('response_format json_schema needs {"name": ..., "schema": {...}}')
        # OpenAI allows a missing schema: any JSON then; we ask for an object.
        schema = spec.get("schema")
        return constraint_for_json_schema({"type": "object"} if schema is None else schema)
    raise GrammarError(f"response_format type {kind!r} is not supported")
