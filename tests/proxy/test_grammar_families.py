"""The Llama 3.1 JSON family's grammars: what each tool_choice lets through, and that what it
lets through parses back into the same calls (the Hermes family: tests/proxy/test_grammar.py)."""

from __future__ import annotations

import json

import llguidance
import pytest

from proxy.chat.grammar import (
    Grammar,
    RowConstraint,
    TokenRejectedError,
    ToolChoice,
    constraint_for_request,
    constraint_for_tools,
)
from proxy.chat.tool_formats import LLAMA3_JSON
from proxy.engines.token_mask import build_tokenizer_info

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
TOOLS = [WEATHER, TIME]
CALL = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'


@pytest.fixture(scope="module")
def info(tokenizer) -> llguidance.LLTokenizer:
    return build_tokenizer_info(tokenizer)


def _feed(tokenizer, info, grammar: Grammar, text: str) -> RowConstraint:
    row = grammar.new_row(info)
    for token in tokenizer.encode(text, add_special_tokens=False):
        row.consume(token)
    return row


def _tools(choice: str | dict, parallel: bool = True) -> Grammar:
    grammar = constraint_for_tools(TOOLS, ToolChoice.of(choice), parallel, LLAMA3_JSON)
    assert grammar is not None
    return grammar


def test_auto_allows_text_or_valid_calls_and_blocks_malformed_ones(tokenizer, info) -> None:
    auto = _tools("auto")
    assert _feed(tokenizer, info, auto, "Just text {with braces}; and more.").is_accepting()
    assert _feed(tokenizer, info, auto, CALL).is_accepting()
    with pytest.raises(TokenRejectedError):
        _feed(tokenizer, info, auto, '{"name": "rm_rf", "parameters": {}}')
    with pytest.raises(TokenRejectedError):  # arguments follow the tool's schema
        _feed(tokenizer, info, auto, '{"name": "get_weather", "parameters": {"city": 1}}')
    with pytest.raises(TokenRejectedError):  # text cannot start like a call (or a blank)
        _feed(tokenizer, info, auto, " " + CALL)


def test_required_takes_one_call_and_nothing_else(tokenizer, info) -> None:
    """One call per answer, even with parallel calls allowed: Meta's templates refuse a history
    turn with several. The parser still reads `;`-joined calls (as vLLM's llama3_json does)."""
    required = _tools("required")
    assert _feed(tokenizer, info, required, CALL).is_stopped()
    two = CALL + '; {"name": "get_time", "parameters": {}}'
    with pytest.raises(TokenRejectedError):
        _feed(tokenizer, info, required, two)
    with pytest.raises(TokenRejectedError):
        _feed(tokenizer, info, required, "Sure: " + CALL)
    content, calls = LLAMA3_JSON.parse_complete(two, {"get_weather", "get_time"})
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]


def test_a_single_or_named_call_stops_the_grammar(tokenizer, info) -> None:
    assert _feed(tokenizer, info, _tools("required", parallel=False), CALL).is_stopped()
    named = _tools({"type": "function", "function": {"name": "get_weather"}})
    assert _feed(tokenizer, info, named, CALL).is_stopped()
    with pytest.raises(TokenRejectedError):
        _feed(tokenizer, info, named, '{"name": "get_time", "parameters": {}}')


def test_a_string_holding_the_closing_markup_is_one_argument(tokenizer, info) -> None:
    value = 'x"}; {"name": "get_time", "parameters": {}}'
    text = '{"name": "get_weather", "parameters": ' + json.dumps({"city": value}) + "}"
    assert _feed(tokenizer, info, _tools("required", parallel=False), text).is_stopped()
    _, calls = LLAMA3_JSON.parse_complete(text)
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"city": value}]


def test_response_format_does_not_depend_on_the_family() -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object"}}}
    grammar = constraint_for_request(fmt, None, None, tool_format=LLAMA3_JSON)
    assert grammar is not None and grammar.kind == "json_schema"
    assert constraint_for_request(None, TOOLS, ToolChoice("none"), tool_format=LLAMA3_JSON) is None
