"""Tool calls and structured outputs through the openai SDK, against a real rlproxy.

With tool_choice "required" or a named tool, and with response_format json_object/json_schema,
the server constrains decoding, so every call and every JSON document must be valid by
construction: these tests check that with `jsonschema`, along with OpenAI's framing of calls
(ids, types, finish_reason "tool_calls", streamed argument fragments).

The module's requests are independent, so the `responses` fixture sends them all at once and
the engine decodes them as one batch of mixed grammars (a realistic load, and many times faster
than one after another on two cores); each test then checks its own response.
"""

from __future__ import annotations

import json
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jsonschema
import pytest
from openai import OpenAI
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessage

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ADD_PROMPT = [{"role": "user", "content": "What is 2 plus 3?"}]
WEATHER_PROMPT = [{"role": "user", "content": "What is the weather in Paris and in London?"}]
CALL_TOKENS = 40  # one call of either tool is about 30 tokens
TAG = "<tool_call>"


def assert_valid_calls(message: ChatCompletionMessage, tools: list[dict[str, Any]]) -> list:
    """Every call: a str id, type "function", a known name, JSON arguments valid for the tool."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    calls = message.tool_calls or []
    for call in calls:
        assert isinstance(call.id, str) and call.id
        assert call.type == "function"
        assert call.function.name in schemas
        args = json.loads(call.function.arguments)
        assert isinstance(args, dict)
        jsonschema.validate(args, schemas[call.function.name])
    assert len({c.id for c in calls}) == len(calls), "tool call ids must be unique"
    return calls


def assert_no_markup(message: ChatCompletionMessage) -> None:
    assert TAG not in (message.content or ""), f"raw tool-call markup in content: {message}"


CITY = {
    # Every field bounded (no free integers: the model can write digits forever), so that a
    # constrained answer always ends within the budget.
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "country": {"type": "string", "maxLength": 12},
        "is_capital": {"type": "boolean"},
    },
    "required": ["name", "country", "is_capital"],
    "additionalProperties": False,
}
CAPITAL_QUESTION = 'What is the capital of France? Answer as {"capital": ...}'
PARALLEL_TOKENS = 72  # two calls and the newline between them

REQUESTS: dict[str, dict[str, Any]] = {
    "none": dict(messages=ADD_PROMPT, tools=[ADD], tool_choice="none", max_tokens=8),
    "auto": dict(messages=ADD_PROMPT, tools=[ADD], tool_choice="auto", max_tokens=CALL_TOKENS),
    "required": dict(
        messages=ADD_PROMPT,
        tools=[ADD],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=CALL_TOKENS,
    ),
    # A budget that ends inside the first call.
    "truncated": dict(messages=ADD_PROMPT, tools=[ADD], tool_choice="required", max_tokens=10),
    "named": dict(
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[ADD, WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=CALL_TOKENS,
    ),
    "parallel": dict(
        messages=WEATHER_PROMPT,
        tools=[WEATHER],
        tool_choice="required",
        max_tokens=PARALLEL_TOKENS,
    ),
    "parallel_false": dict(
        messages=WEATHER_PROMPT,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=CALL_TOKENS,
    ),
    "tool_result": dict(
        messages=[
            *ADD_PROMPT,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "5"},
        ],
        tools=[ADD],
        max_tokens=CALL_TOKENS,
    ),
    "json_schema": dict(
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "city", "schema": CITY, "strict": True},
        },
        max_tokens=CALL_TOKENS,
    ),
    "json_object": dict(
        messages=[
            {"role": "system", "content": "You answer in JSON."},
            {"role": "user", "content": CAPITAL_QUESTION},
        ],
        response_format={"type": "json_object"},
        max_tokens=CALL_TOKENS,
    ),
}


@pytest.fixture(scope="module")
def responses(client: OpenAI, pool: ThreadPoolExecutor) -> dict[str, Future]:
    """Every request above, plus two streamed ones, in flight together; futures by name."""
    create = client.chat.completions.create
    futures = {
        name: pool.submit(create, model="rlproxy", temperature=0, **kwargs)
        for name, kwargs in REQUESTS.items()
    }
    futures["parallel_streamed"] = pool.submit(
        lambda: list(create(model="rlproxy", temperature=0, stream=True, **REQUESTS["parallel"]))
    )
    futures["truncated_streamed"] = pool.submit(
        lambda: list(create(model="rlproxy", temperature=0, stream=True, **REQUESTS["truncated"]))
    )
    return futures


def response(responses: dict[str, Future], name: str) -> ChatCompletion:
    return responses[name].result(timeout=300)


# ----------------------------------------------------------------------------- tool_choice


def test_tool_choice_none(responses: dict[str, Future]) -> None:
    choice = response(responses, "none").choices[0]
    assert not choice.message.tool_calls
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")


def test_tool_choice_auto(responses: dict[str, Future]) -> None:
    choice = response(responses, "auto").choices[0]
    calls = assert_valid_calls(choice.message, [ADD])
    assert_no_markup(choice.message)
    if calls:
        assert choice.finish_reason == "tool_calls"
    else:
        assert isinstance(choice.message.content, str) and choice.message.content
        assert choice.finish_reason in ("stop", "length")


def test_tool_choice_required(responses: dict[str, Future]) -> None:
    choice = response(responses, "required").choices[0]
    calls = assert_valid_calls(choice.message, [ADD])
    assert len(calls) == 1
    assert choice.finish_reason == "tool_calls"
    assert not choice.message.content


def test_truncated_tool_call_leaks_no_markup(responses: dict[str, Future]) -> None:
    """A budget that ends inside a call: finish_reason "length", and no raw tags in content."""
    choice = response(responses, "truncated").choices[0]
    assert choice.finish_reason == "length"
    assert_no_markup(choice.message)


def test_truncated_streamed_tool_call_leaks_no_markup(responses: dict[str, Future]) -> None:
    chunks: list[ChatCompletionChunk] = responses["truncated_streamed"].result(timeout=300)
    content = "".join(c.delta.content or "" for ch in chunks for c in ch.choices)
    finish = [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason]
    assert finish == ["length"]
    assert TAG not in content, f"raw tool-call markup in streamed content: {content!r}"


def test_named_tool_choice(responses: dict[str, Future]) -> None:
    choice = response(responses, "named").choices[0]
    calls = assert_valid_calls(choice.message, [ADD, WEATHER])
    assert [c.function.name for c in calls] == ["get_weather"]
    assert choice.finish_reason == "tool_calls"


# ----------------------------------------------------------------------------- parallel calls


def test_parallel_tool_calls(responses: dict[str, Future]) -> None:
    choice = response(responses, "parallel").choices[0]
    calls = assert_valid_calls(choice.message, [WEATHER])
    assert len(calls) >= 2, f"expected one call per city, got {choice.message}"
    assert choice.finish_reason == "tool_calls"
    assert_no_markup(choice.message)


def test_parallel_tool_calls_false(responses: dict[str, Future]) -> None:
    choice = response(responses, "parallel_false").choices[0]
    calls = assert_valid_calls(choice.message, [WEATHER])
    assert len(calls) == 1
    assert choice.finish_reason == "tool_calls"


def test_streamed_tool_calls(responses: dict[str, Future]) -> None:
    chunks: list[ChatCompletionChunk] = responses["parallel_streamed"].result(timeout=300)
    calls: dict[int, dict[str, Any]] = {}
    finish: list[str] = []
    content = ""
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            if choice.finish_reason is not None:
                finish.append(choice.finish_reason)
            for d in choice.delta.tool_calls or []:
                if d.index not in calls:
                    # The first delta of a call carries its id, type and name, once.
                    assert isinstance(d.id, str) and d.id
                    assert d.type == "function"
                    assert d.function is not None and d.function.name
                    calls[d.index] = {"id": d.id, "name": d.function.name, "args": ""}
                else:
                    assert d.id is None and (d.function is None or d.function.name is None)
                if d.function is not None and d.function.arguments:
                    calls[d.index]["args"] += d.function.arguments
    assert finish == ["tool_calls"]
    assert TAG not in content
    assert sorted(calls) == list(range(len(calls)))
    assert len({c["id"] for c in calls.values()}) == len(calls)
    schema = WEATHER["function"]["parameters"]
    for call in calls.values():
        jsonschema.validate(json.loads(call["args"]), schema)
    # Temperature 0: the same calls as the non-streamed response.
    expected = [
        (c.function.name, json.loads(c.function.arguments))
        for c in response(responses, "parallel").choices[0].message.tool_calls or []
    ]
    assert [(c["name"], json.loads(c["args"])) for _, c in sorted(calls.items())] == expected


# ----------------------------------------------------------------------------- conversations


def test_conversation_with_tool_result(responses: dict[str, Future]) -> None:
    """History with an assistant message (content None + tool_calls) and a tool result."""
    choice = response(responses, "tool_result").choices[0]
    calls = assert_valid_calls(choice.message, [ADD])
    assert_no_markup(choice.message)
    assert calls or choice.message.content


# ----------------------------------------------------------------------------- response_format


def test_json_schema_response_format(responses: dict[str, Future]) -> None:
    choice = response(responses, "json_schema").choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), CITY)


def test_json_object_response_format(responses: dict[str, Future]) -> None:
    choice = response(responses, "json_object").choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(json.loads(choice.message.content), dict)
