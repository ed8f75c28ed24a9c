"""Llama 3.1 JSON tool calls: whole texts, streamed deltas and their agreement over random
splits; and, for every family, closing markup inside a JSON string never ends a call."""

from __future__ import annotations

import json
import random

import pytest

from proxy.chat.tool_formats import FORMATS, LLAMA3_JSON
from proxy.chat.tool_parser import TextDelta
from proxy.chat.tool_parser_llama3 import Llama3JsonStreamParser
from tests.proxy.tool_events import collect

parse_complete = LLAMA3_JSON.parse_complete  # a whole output, as the chat service parses it

CALL_W = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
CALL_T = '{"name": "get_time", "arguments": {}}'

CORPUS = [
    "",
    "Hello, world!",
    "  leading blanks stay content",
    CALL_W,
    CALL_W + "; " + CALL_T,
    "<|python_tag|>" + CALL_W,
    '\n{ "name" : "a" , "parameters" :{"x": {"y": [1, 2, {}]}} }',
    '{"name": "q\\"uote", "parameters": {"s": "}; {\\"name\\": \\"x\\"}"}}',
    "{not a call}",
    '{"parameters": {}, "name": "a"}',  # wrong order: content
    '{"name": "a", "parameters": {"q": 1',  # cut short: a call
    '{"name": "a", "parameters": ',  # cut after the header: a call, no arguments
    '{"name": "a", "param',  # header never complete: dropped
    CALL_W + "; " + '{"name": "get_ti',
    CALL_W + " and then text",
    CALL_W + "; " + CALL_W,  # an exact repeat: dropped
    '{"name": "n", "parameters": 5}',
    '{"name": "u", "parameters": {"s": "café ✓"}}',
]


def _strip_ids(calls: list[dict]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def _stream(text: str, cuts: list[int], **kw) -> tuple[list, Llama3JsonStreamParser]:
    parser = Llama3JsonStreamParser(**kw)
    events, prev = [], 0
    for cut in [*cuts, len(text)]:
        events += parser.feed(text[prev:cut])
        prev = cut
    events += parser.finish()
    return events, parser


def test_text_calls_and_edges() -> None:
    assert parse_complete("Hello") == ("Hello", [])
    assert parse_complete("  leading blanks stay content") == ("  leading blanks stay content", [])
    content, calls = parse_complete(CALL_W + "; " + CALL_T)
    assert content is None
    assert _strip_ids(calls) == [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert _strip_ids(parse_complete("<|python_tag|>" + CALL_W)[1]) == [
        ("get_weather", '{"city": "Paris"}')
    ]
    assert parse_complete("{not a call}") == ("{not a call}", [])
    assert _strip_ids(parse_complete('{"name": "a", "parameters": {"q": 1')[1]) == [
        ("a", '{"q": 1')
    ]
    assert parse_complete('{"name": "a", "param') == ("", [])
    assert _strip_ids(parse_complete(CALL_W + "; " + CALL_W)[1]) == [
        ("get_weather", '{"city": "Paris"}')
    ]
    assert parse_complete(CALL_W + " and then text")[0] == "and then text"
    assert _strip_ids(parse_complete('{"name": "n", "parameters": 5}')[1]) == [("n", "5")]


def test_names_outside_the_tools_are_content() -> None:
    content, calls = parse_complete(CALL_W, tool_names={"get_time"})
    assert (content, calls) == (CALL_W, [])
    assert len(parse_complete(CALL_W, tool_names={"get_weather"})[1]) == 1


@pytest.mark.parametrize("text", CORPUS)
def test_any_split_matches_parse_complete(text: str) -> None:
    expected_content, expected_calls = parse_complete(text)
    rng = random.Random(text)
    splits = [[], list(range(1, len(text)))]
    for _ in range(30):
        k = rng.randint(0, max(0, min(len(text) - 1, 8)))
        splits.append(sorted(rng.sample(range(1, len(text)), k)) if len(text) > 1 else [])
    for cuts in splits:
        events, parser = _stream(text, cuts)
        content, calls = collect(events)
        assert content == expected_content, cuts
        assert _strip_ids(calls) == _strip_ids(expected_calls), cuts
        assert calls == parser.tool_calls
        assert all(not (isinstance(e, TextDelta) and e.text == "") for e in events)


def test_arguments_stream_as_they_arrive() -> None:
    parser = Llama3JsonStreamParser()
    assert parser.feed('{"name": "f", "parameters": ') != []  # the call starts with its header
    fragments = [parser.feed(piece) for piece in ('{"city": "Pa', 'ris"', "}", "}")]
    assert [[e.fragment for e in evs] for evs in fragments] == [
        ['{"city": "Pa'],
        ['ris"'],
        ["}"],
        [],
    ]
    assert parser.finish() == []


@pytest.mark.parametrize("family", sorted(FORMATS))
@pytest.mark.parametrize(
    "value",
    [
        "<b>x</b> then </tool_call> appears",
        "a}</tool_call>",
        '} </tool_call> \\" }</tool_call>',
        'a}; {"name": "f", "parameters": {}}',
        "}}}; ;",
    ],
)
@pytest.mark.parametrize("tool_names", [None, {"f", "get_weather"}])
def test_closing_markup_inside_a_json_string_does_not_end_the_call(
    family: str, value: str, tool_names: set[str] | None
) -> None:
    """Every family's grammar lets a string value hold its closing markup; every parser follows
    JSON strings, streamed or not, alone or as a later (held) parallel call."""
    fmt = FORMATS[family]
    arguments = json.dumps({"html": value})
    one = fmt.render_calls([("f", arguments)])
    two = fmt.render_calls([("get_weather", '{"city": "Paris"}'), ("f", arguments)])
    for text in (one, two):
        content, calls = fmt.parse_complete(text, tool_names)
        assert content is None, text
        assert json.loads(calls[-1]["function"]["arguments"]) == {"html": value}
        parser = fmt.parser(tool_names)
        events = [ev for ch in text for ev in parser.feed(ch)] + parser.finish()
        assert _strip_ids(collect(events)[1]) == _strip_ids(calls)


def test_the_issue_example_parses_in_the_llama3_family() -> None:
    text = LLAMA3_JSON.render_calls(
        [("f", json.dumps({"html": "<b>x</b> then </tool_call> appears"}))]
    )
    content, calls = LLAMA3_JSON.parse_complete(text)
    assert content is None
    assert json.loads(calls[0]["function"]["arguments"]) == {
        "html": "<b>x</b> then </tool_call> appears"
    }
