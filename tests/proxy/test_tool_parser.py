"""Tool call parsing: whole texts, streamed deltas, and their agreement over random splits."""

from __future__ import annotations

import json
import random
import re

import pytest

from proxy.chat.tool_formats import HERMES
from proxy.chat.tool_parser import (
    TextDelta,
    ToolCallArgsDelta,
    ToolCallStart,
    ToolCallStreamParser,
    new_call_id,
)
from tests.proxy.tool_events import collect

parse_complete = HERMES.parse_complete  # a whole output, as the chat service parses it

CALL_W = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
CALL_T = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'

# Texts the equivalence test splits at random; they cover every branch of the parser.
CORPUS = [
    "",
    "Hello, world!",
    "Trailing whitespace  \n",
    CALL_W,
    "Sure.\n" + CALL_W + "\n" + CALL_T + "\n",
    "Let me check. " + CALL_W + "  \n\nAnd more text.",
    '<tool_call>\n{"name": "a", "arguments": {"x": {"y": [1, 2, {}]}} }\n</tool_call>',
    '<tool_call>{ "name" : "q\\"uote", "arguments" :{"s": "}</tool_"}}</tool_call>',
    "Hi <tool_call>junk and more",  # malformed: plain text, tag included
    "a < b and <tool_ca",  # partial tag at the end: plain text
    '<tool_call>{"name": "a", "arguments": {"q": 1',  # cut short: a call
    '<tool_call>{"name": "a", "arguments": ',  # cut after the header: a call, no arguments
    '<tool_call>{"name": "a", "argum',  # header never complete: text
    '<tool_call>{"arguments": {}, "name": "a"}</tool_call>',  # wrong order: text
    '<tool_call>{"name": "a\nb", "arguments": {}}</tool_call>',  # raw newline in name: text
    "x " + CALL_W + " <tool_call>nope " + CALL_T,
    "unicode ✓ café " + CALL_W,
    CALL_W + "\n<tool",  # cut while starting the next call
    CALL_W + '\n<tool_call>{"name": "get_ti',
    CALL_W + " and <tool",
    # The closing markup inside a JSON string of the arguments is part of the string.
    '<tool_call>{"name": "f", "arguments": {"html": "<b>x</b> then </tool_call> appears"}}'
    "</tool_call>",
    '<tool_call>{"name": "f", "arguments": {"s": "a}</tool_call> \\" }</tool_call>"}}</tool_call>',
    CALL_W + '\n<tool_call>{"name": "f", "arguments": {"s": "}</tool_call>"}}</tool_call>',
]


def _strip_ids(calls: list[dict]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def _stream(text: str, cuts: list[int], **kw) -> tuple[list, ToolCallStreamParser]:
    parser = ToolCallStreamParser(**kw)
    events = []
    prev = 0
    for cut in [*cuts, len(text)]:
        events += parser.feed(text[prev:cut])
        prev = cut
    events += parser.finish()
    return events, parser


def test_plain_text_is_content() -> None:
    assert parse_complete("Hello there") == ("Hello there", [])
    assert parse_complete("") == ("", [])


def test_single_call_shape() -> None:
    content, calls = parse_complete(CALL_W)
    assert content is None
    assert len(calls) == 1
    call = calls[0]
    assert re.fullmatch(r"call_[A-Za-z0-9]{24}", call["id"])
    assert call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_text_then_several_calls_drops_separating_whitespace() -> None:
    content, calls = parse_complete("Sure.\n" + CALL_W + "\n" + CALL_T + "\n")
    assert content == "Sure."
    assert _strip_ids(calls) == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    assert len({c["id"] for c in calls}) == 2


def test_flexible_whitespace_inside_the_call() -> None:
    text = '<tool_call>\n{ "name" : "a" , "arguments" : {"x": {"y": 1}} }\n</tool_call>'
    assert _strip_ids(parse_complete(text)[1]) == [("a", '{"x": {"y": 1}}')]


def test_malformed_call_is_plain_text() -> None:
    for text in [
        "Hi <tool_call>junk",
        '<tool_call>{"arguments": {}, "name": "a"}</tool_call>',
    ]:
        assert parse_complete(text) == (text, [])


def test_a_call_cut_off_inside_its_header_is_neither_call_nor_content() -> None:
    """max_tokens can end the output inside `<tool_call>{"name": ...`: no markup leaks."""
    for text, content in [
        ('<tool_call>{"name": "a", "argu', ""),
        ('Let me check. <tool_call>{"name', "Let me check."),
    ]:
        assert parse_complete(text) == (content, [])
        parser = ToolCallStreamParser()
        events = [ev for ch in text for ev in parser.feed(ch)] + parser.finish()
        assert collect(events) == (content, [])


def test_unknown_tool_name_is_text_when_names_are_given() -> None:
    content, calls = parse_complete(CALL_W, tool_names={"get_time"})
    assert (content, calls) == (CALL_W, [])
    assert len(parse_complete(CALL_W, tool_names={"get_weather"})[1]) == 1


def test_truncated_call_keeps_its_arguments() -> None:
    content, calls = parse_complete('ok <tool_call>{"name": "a", "arguments": {"q": 1')
    assert content == "ok"
    assert _strip_ids(calls) == [("a", '{"q": 1')]
    # Cut right after the header: a call with no arguments yet.
    assert _strip_ids(parse_complete('<tool_call>{"name": "a", "arguments": ')[1]) == [("a", "")]


def test_next_call_cut_short_after_a_call_is_dropped() -> None:
    for tail in ["\n<tool", "\n<tool_call>", '\n<tool_call>{"name": "get_ti']:
        content, calls = parse_complete(CALL_W + tail)
        assert content is None
        assert _strip_ids(calls) == [("get_weather", '{"city": "Paris"}')]
    # Only right after a call: elsewhere an unfinished tag is text.
    assert parse_complete("a <tool") == ("a <tool", [])
    assert parse_complete(CALL_W + " b <tool")[0] == "b <tool"


def test_partial_tag_is_held_back_until_disambiguated() -> None:
    parser = ToolCallStreamParser()
    assert parser.feed("Hello <tool") == [TextDelta("Hello")]
    assert parser.feed("box>") == [TextDelta(" <toolbox>")]
    parser = ToolCallStreamParser()
    assert parser.feed("Hello <tool") == [TextDelta("Hello")]
    events = parser.feed('_call>{"name": "f", "arguments": {"a"')
    assert [type(e) for e in events] == [ToolCallStart, ToolCallArgsDelta]
    assert events[0].name == "f" and events[1].fragment == '{"a"'


def test_arguments_stream_before_the_call_ends() -> None:
    parser = ToolCallStreamParser()
    parser.feed('<tool_call>{"name": "f", "arguments": ')
    assert parser.feed('{"city": "Par') == [ToolCallArgsDelta(0, '{"city": "Par')]
    # A "}" might be the call's own closing brace: held back until the tag decides.
    assert parser.feed('is"}') == [ToolCallArgsDelta(0, 'is"')]
    assert parser.feed("}</tool") == [ToolCallArgsDelta(0, "}")]
    assert parser.feed("_call>\n\n") == []
    assert parser.feed("done") == [TextDelta("done")]
    assert parser.finish() == []
    assert parser.tool_calls[0]["function"]["arguments"] == '{"city": "Paris"}'


@pytest.mark.parametrize("text", CORPUS)
def test_any_split_matches_parse_complete(text: str) -> None:
    expected_content, expected_calls = parse_complete(text)
    rng = random.Random(text)
    splits = [[], list(range(1, len(text)))]  # whole, and one character at a time
    for _ in range(30):
        k = rng.randint(0, max(0, min(len(text) - 1, 8)))
        splits.append(sorted(rng.sample(range(1, len(text)), k)) if len(text) > 1 else [])
    for cuts in splits:
        events, parser = _stream(text, cuts)
        content, calls = collect(events)
        assert content == expected_content, cuts
        assert _strip_ids(calls) == _strip_ids(expected_calls), cuts
        # The events and the parser's own record agree, ids included.
        assert calls == parser.tool_calls
        assert all(not (isinstance(e, TextDelta) and e.text == "") for e in events)


def test_constrained_style_arguments_parse_as_json() -> None:
    args = {"city": "Paris", "unit": "celsius", "nested": {"a": [1, 2]}}
    text = f'<tool_call>{{"name": "w", "arguments": {json.dumps(args)}}}</tool_call>'
    for cuts in ([], list(range(1, len(text)))):
        events, _ = _stream(text, cuts)
        _, calls = collect(events)
        assert json.loads(calls[0]["function"]["arguments"]) == args


def test_call_ids_are_unique_openai_style() -> None:
    ids = {new_call_id() for _ in range(200)}
    assert len(ids) == 200
    assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", i) for i in ids)


def _call(name: str, args: str) -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {args}}}</tool_call>'


def test_an_exact_repeat_of_a_call_is_dropped_streamed_or_not() -> None:
    text = "\n".join(
        [
            _call("get_weather", '{"city": "Paris"}'),
            _call("get_weather", '{"city":  "Paris"}'),  # same call, other whitespace
            _call("get_weather", '{"city": "London"}'),
        ]
    )
    content, calls = parse_complete(text)
    assert content is None
    assert [c["function"]["arguments"] for c in calls] == [
        '{"city": "Paris"}',
        '{"city": "London"}',
    ]
    parser = ToolCallStreamParser()
    events = [ev for ch in text for ev in parser.feed(ch)] + parser.finish()
    streamed_content, streamed = collect(events)
    assert streamed_content is None
    assert [c["function"] for c in streamed] == [c["function"] for c in calls]
    assert [c["id"] for c in streamed] == [c["id"] for c in parser.tool_calls]


def test_a_later_call_cut_off_by_max_tokens_is_kept_partial() -> None:
    text = _call("a", "{}") + "\n" + '<tool_call>{"name": "b", "arguments": {"x": 1'
    _, calls = parse_complete(text)
    assert [c["function"]["name"] for c in calls] == ["a", "b"]
    assert calls[1]["function"]["arguments"] == '{"x": 1'


@pytest.mark.parametrize(
    "value",
    ["<b>x</b> then </tool_call> appears", "a}</tool_call>", '} </tool_call> \\" }</tool_call>'],
)
@pytest.mark.parametrize("tool_names", [None, {"f", "get_weather"}])
def test_closing_markup_inside_a_json_string_does_not_end_the_call(
    value: str, tool_names: set[str] | None
) -> None:
    """The grammar lets a string value hold `}</tool_call>`; the parser follows JSON strings."""
    arguments = json.dumps({"html": value})
    one = f'<tool_call>{{"name": "f", "arguments": {arguments}}}</tool_call>'
    for text in (one, CALL_W + "\n" + one):  # alone, and as a later (held) parallel call
        content, calls = parse_complete(text, tool_names)
        assert content is None
        assert json.loads(calls[-1]["function"]["arguments"]) == {"html": value}
        events, _ = _stream(text, list(range(1, len(text))))
        assert _strip_ids(collect(events)[1]) == _strip_ids(calls)


@pytest.mark.parametrize("second", [False, True])
def test_a_call_cut_before_its_end_tag_keeps_only_its_arguments(second: bool) -> None:
    """max_tokens may stop the output right after a call's JSON, before `</tool_call>`: the
    brace that closes the call object is not part of its arguments (a repeat is then seen as
    one, and dropped)."""
    cut = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
    text = (CALL_W + "\n" if second else "") + cut
    for cuts in ([], [len(text) - 1], [len(text) - 2, len(text) - 1]):
        _, parser = _stream(text, cuts)
        assert _strip_ids(parser.tool_calls) == [("get_weather", '{"city": "Paris"}')]
    _, calls = parse_complete(text)
    assert _strip_ids(calls) == [("get_weather", '{"city": "Paris"}')]
