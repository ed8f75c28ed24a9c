"""Anthropic's Messages API against a real rlproxy, with the anthropic SDK as its docs show it.

`messages.create`, `messages.stream`, a `tool_use`/`tool_result` round trip, the four stop
reasons, `count_tokens`, and Anthropic's error shape. The raw event stream is read with httpx
where the SDK hides events (`ping`). A conversation that moves between protocols stays one
trajectory. Claude Code's first request, as it sends it, is answered and stored.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import openai
import pytest
from openai import OpenAI

from tests.e2e.conftest import Server
from tests.e2e.helpers import get_trajectory, typed_events

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
HELLO = [{"role": "user", "content": "Say hello to Bob."}]
# What every answer names as its model, whatever name it asked for: the version that served it
# (the shared server's policy serves the base model).
SERVED = "rlproxy@base"


@pytest.fixture(scope="module")
def claude(server: Server):
    with anthropic.Anthropic(base_url=server.url, api_key="sk-test", max_retries=0) as c:
        yield c


def raw_events(server: Server, body: dict[str, Any]) -> list[dict[str, Any]]:
    headers = {"x-api-key": "sk-test", "anthropic-version": "2023-06-01"}
    return typed_events(f"{server.url}/v1/messages", body, headers)


@pytest.fixture(scope="module")
def greedy_message(claude: anthropic.Anthropic):
    # anthropic 2.x has no `temperature` argument; the wire field is still Anthropic's.
    return claude.messages.create(
        model="rlproxy", max_tokens=12, messages=HELLO, extra_body={"temperature": 0}
    )


def test_create_returns_a_message(greedy_message) -> None:
    m = greedy_message
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant"
    assert m.model == SERVED
    [block] = m.content
    assert block.type == "text" and block.text
    assert m.stop_reason in ("end_turn", "max_tokens")
    assert m.usage.input_tokens > 0 and 0 < m.usage.output_tokens <= 12


def test_stream_equals_create(claude: anthropic.Anthropic, greedy_message) -> None:
    with claude.messages.stream(
        model="rlproxy", max_tokens=12, messages=HELLO, extra_body={"temperature": 0}
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == greedy_message.content[0].text
    assert final.stop_reason == greedy_message.stop_reason
    assert final.usage.output_tokens == greedy_message.usage.output_tokens


def test_raw_event_sequence(server: Server, greedy_message) -> None:
    evs = raw_events(
        server, {"model": "rlproxy", "max_tokens": 12, "messages": HELLO, "temperature": 0}
    )
    kinds = [e["type"] for e in evs]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    start = evs[0]["message"]
    assert start["id"].startswith("msg_") and start["content"] == []
    assert start["model"] == SERVED
    assert start["usage"]["input_tokens"] == greedy_message.usage.input_tokens
    assert evs[-2]["delta"]["stop_reason"] == greedy_message.stop_reason
    assert evs[-2]["usage"]["output_tokens"] == greedy_message.usage.output_tokens


def test_stop_reasons(claude: anthropic.Anthropic) -> None:
    cut = claude.messages.create(
        model="rlproxy", max_tokens=2, messages=[{"role": "user", "content": "Write a story."}]
    )
    assert cut.stop_reason == "max_tokens" and cut.stop_sequence is None
    stopped = claude.messages.create(
        model="rlproxy",
        max_tokens=64,
        messages=[{"role": "user", "content": "Write a long story."}],
        stop_sequences=[" "],
    )
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == " "
    assert " " not in stopped.content[0].text


def test_tool_use_round_trip_is_one_trajectory(claude: anthropic.Anthropic, server: Server) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = claude.messages.create(
        model="rlproxy",
        max_tokens=64,
        system="You answer questions about the weather.",
        messages=ask,
        tools=[WEATHER],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        # Greedy: sampled, a long city can run past 64 tokens and cut the input.
        extra_body={"temperature": 0},
    )
    assert first.stop_reason == "tool_use"
    [use] = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and isinstance(use.input, dict) and "city" in use.input
    second = claude.messages.create(
        model="rlproxy",
        max_tokens=8,
        system="You answer questions about the weather.",
        tools=[WEATHER],
        messages=[
            *ask,
            {"role": "assistant", "content": first.content},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny"}],
            },
        ],
    )
    turns = get_trajectory(server, second.id)["turns"]  # a message id names its trajectory
    assert [t["completion_id"] for t in turns] == [first.id, second.id]
    assert {t["protocol"] for t in turns} == {"messages"}
    assert [m["role"] for m in turns[1]["request_messages"]] == [
        "system",
        "user",
        "assistant",
        "tool",
    ]


def test_streamed_tool_input_arrives_as_json_deltas(server: Server) -> None:
    evs = raw_events(
        server,
        {
            "model": "rlproxy",
            "max_tokens": 64,
            "messages": [{"role": "user", "content": "Weather in Rome?"}],
            "tools": [WEATHER],
            "tool_choice": {"type": "tool", "name": "get_weather"},
            # Greedy: sampled, the 135M model can write a city long enough that 64 tokens cut
            # the input (stop_reason max_tokens, the JSON a prefix).
            "temperature": 0,
        },
    )
    [start] = [e for e in evs if e["type"] == "content_block_start"]
    assert start["content_block"]["type"] == "tool_use"
    assert start["content_block"]["name"] == "get_weather"
    parts = [e["delta"]["partial_json"] for e in evs if e["type"] == "content_block_delta"]
    assert {e["delta"]["type"] for e in evs if e["type"] == "content_block_delta"} == {
        "input_json_delta"
    }
    assert "city" in json.loads("".join(parts))
    assert evs[-2]["delta"]["stop_reason"] == "tool_use"


def test_structured_output(claude: anthropic.Anthropic) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["city", "population"],
        "additionalProperties": False,
    }
    m = claude.messages.create(
        model="rlproxy",
        max_tokens=64,
        messages=[{"role": "user", "content": "Describe a city."}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
        # Greedy: sampled, the 135M model sometimes writes an integer long enough for 64
        # tokens to cut it (stop_reason max_tokens, the text a JSON prefix).
        extra_body={"temperature": 0},
    )
    assert m.stop_reason == "end_turn", m.stop_reason
    value = json.loads(m.content[0].text)
    assert set(value) == {"city", "population"} and isinstance(value["population"], int)


def test_count_tokens_matches_usage(claude: anthropic.Anthropic, greedy_message) -> None:
    counted = claude.messages.count_tokens(model="rlproxy", messages=HELLO)
    assert counted.input_tokens == greedy_message.usage.input_tokens


def test_one_conversation_across_protocols(
    claude: anthropic.Anthropic, client: OpenAI, server: Server
) -> None:
    """Turn 1 through Chat Completions, turn 2 through Messages: one trajectory."""
    ask = [{"role": "user", "content": "Name a colour."}]
    first = client.chat.completions.create(model="rlproxy", messages=ask, max_tokens=6)
    answer = first.choices[0].message.content or ""
    second = claude.messages.create(
        model="rlproxy",
        max_tokens=6,
        messages=[
            *ask,
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "Another?"},
        ],
    )
    turns = get_trajectory(server, second.id)["turns"]
    assert [(t["completion_id"], t["protocol"]) for t in turns] == [
        (first.id, "chat"),
        (second.id, "messages"),
    ]


def test_reward_by_message_id(claude: anthropic.Anthropic, server: Server) -> None:
    m = claude.messages.create(model="rlproxy", max_tokens=4, messages=HELLO)
    r = httpx.post(
        f"{server.url}/rl/trajectories/{m.id}/reward", json={"reward": 0.5, "source": "env"}
    )
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("body", "status", "kind"),
    [
        ({"model": "rlproxy", "messages": HELLO}, 400, "invalid_request_error"),  # no max_tokens
        ({"model": "nope", "max_tokens": 4, "messages": HELLO}, 404, "not_found_error"),
        (
            {"model": "rlproxy", "max_tokens": 4, "messages": [{"role": "tool", "content": "x"}]},
            400,
            "invalid_request_error",
        ),
        (
            {
                "model": "rlproxy",
                "max_tokens": 4,
                "messages": [{"role": "user", "content": [{"type": "document"}]}],
            },
            400,
            "invalid_request_error",
        ),
        (
            {
                "model": "rlproxy",
                "max_tokens": 4,
                "messages": HELLO,
                "tools": [{"type": "web_search_20250305", "name": "web_search"}],
            },
            400,
            "invalid_request_error",
        ),
        (
            {"model": "rlproxy", "max_tokens": 4, "messages": HELLO, "temperature": 1.5},
            400,
            "invalid_request_error",
        ),
    ],
)
def test_errors_in_anthropic_shape(server: Server, body: dict, status: int, kind: str) -> None:
    r = httpx.post(f"{server.url}/v1/messages", json=body, timeout=30)
    assert r.status_code == status, r.text
    payload = r.json()
    assert payload["type"] == "error"
    assert payload["error"]["type"] == kind and payload["error"]["message"]
    assert payload["request_id"] == r.headers["x-request-id"]


def test_sdk_raises_its_own_errors(claude: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as caught:
        claude.messages.create(model="nope", max_tokens=4, messages=HELLO)
    assert "nope" in str(caught.value)
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model="rlproxy", max_tokens=0, messages=HELLO)


def test_unknown_path_under_messages_is_anthropic_shaped(server: Server) -> None:
    r = httpx.get(f"{server.url}/v1/messages/batches", timeout=30)
    assert r.status_code in (404, 405)
    assert r.json()["type"] == "error"


# ----------------------------------------------------------------------------- Claude Code


def claude_code_body() -> dict[str, Any]:
    """A request shaped as Claude Code 2.1.332 sends its first (docs: CODING-AGENTS.md): its
    default model name, `system` blocks with `cache_control`, a `role: "system"` message inside
    `messages`, `max_tokens` 32,000, adaptive thinking, effort, context management, a deferred
    tool. Its one tool is forced and takes an enum, so the answer ends in a few tokens."""
    bash = {
        "name": "Bash",
        "description": "Run a shell command.",
        "input_schema": {
            "type": "object",
            "properties": {"command": {"type": "string", "enum": ["echo hello"]}},
            "required": ["command"],
        },
    }
    cached = {"type": "ephemeral"}
    return {
        "model": "claude-opus-5-5",
        "max_tokens": 32_000,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332;"},
            {"type": "text", "text": "You are Claude Code.", "cache_control": cached},
        ],
        "messages": [
            {
                "role": "system",
                "content": [
                    {"type": "text", "text": "Working directory: /tmp", "cache_control": cached}
                ],
            },
            {
                "role": "user",
                "content": [{"type": "text", "text": "Reply with the word hello."}],
            },
        ],
        "tools": [
            bash,
            {**WEATHER, "name": "DeferredToolPlaceholder", "defer_loading": True},
        ],
        "tool_choice": {"type": "tool", "name": "Bash"},
        "thinking": {"type": "adaptive", "display": "omitted"},
        "output_config": {"effort": "medium"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "metadata": {"user_id": json.dumps({"device_id": "d", "session_id": "s"})},
        "stream": True,
    }


def test_claude_codes_first_request_is_answered_and_stored(server: Server) -> None:
    headers = {
        "x-api-key": "sk-test",
        "anthropic-version": "2023-06-01",
        "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14",
        "x-app": "cli",
        "user-agent": "claude-cli/2.1.332 (external, sdk-cli)",
    }
    url = f"{server.url}/v1/messages?beta=true"
    with httpx.stream("POST", url, json=claude_code_body(), headers=headers, timeout=120) as r:
        assert r.status_code == 200, r.read()
        budget = r.headers["x-rlproxy-output-budget"]
        version = r.headers["x-rlproxy-version"]
        evs = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    start = evs[0]["message"]
    assert (start["model"], version) == (SERVED, "base")
    assert budget == f"used={8192 - start['usage']['input_tokens']}; requested=32000"
    assert evs[-2]["delta"]["stop_reason"] == "tool_use"
    [turn] = get_trajectory(server, start["id"])["turns"]
    assert turn["model_requested"] == "claude-opus-5-5"
    assert [m["role"] for m in turn["request_messages"]] == ["system", "system", "user"]


def test_claude_model_names_are_the_policy_here_and_unknown_elsewhere(
    claude: anthropic.Anthropic, client: OpenAI
) -> None:
    raw = claude.messages.with_raw_response.create(
        model="claude-haiku-4-5", max_tokens=2, messages=HELLO
    )
    m = raw.parse()
    assert m.model == SERVED and m.usage.output_tokens <= 2
    assert raw.headers["x-rlproxy-version"] == "base"
    with pytest.raises(openai.NotFoundError):  # Chat Completions keeps OpenAI's 404
        client.chat.completions.create(model="claude-haiku-4-5", messages=HELLO, max_tokens=2)


THOUGHT = "The user wants one word: hello."
CLAUDE_IGNORED = "context_management, output_config.effort, thinking, tools.defer_loading"


def test_claude_codes_thinking_is_kept_and_what_it_ignores_is_named(server: Server) -> None:
    """Claude Code's fields on two turns of one conversation. `thinking`, `output_config.effort`,
    `context_management` and a tool's `defer_loading` are accepted with no effect and named in
    `X-RLProxy-Ignored-Fields` (non-streamed and streamed); `cache_control` (served by the prefix
    cache) and `metadata.user_id` (the call's `user`) are not. The second turn sends the first
    answer back with a thinking block before it, as Claude Code does: the stored turn keeps its
    text, the prompt the model is shown is the same without it (SmolLM2's template has no place
    for reasoning), and the turns are one trajectory. `tool_choice: none` keeps the answer to a
    few words; the tools are still declared."""
    headers = {"x-api-key": "sk-test", "anthropic-version": "2023-06-01"}
    first_body = {**claude_code_body(), "max_tokens": 4, "tool_choice": {"type": "none"}}
    first_body.pop("stream")
    r = httpx.post(f"{server.url}/v1/messages", json=first_body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    assert r.headers["x-rlproxy-ignored-fields"] == CLAUDE_IGNORED
    first = r.json()
    answer = first["content"][0]["text"]

    cached = {"type": "ephemeral"}
    thinking = {"type": "thinking", "thinking": THOUGHT, "signature": "EqQBCkYIBxgCKkB-opaque"}
    history = [
        *first_body["messages"],
        {"role": "assistant", "content": [thinking, {"type": "text", "text": answer}]},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Now the word bye.", "cache_control": cached}],
        },
    ]
    second_body = {**first_body, "messages": history}
    url = f"{server.url}/v1/messages"
    with httpx.stream("POST", url, json={**second_body, "stream": True}, headers=headers) as s:
        assert s.status_code == 200, s.read()
        assert s.headers["x-rlproxy-ignored-fields"] == CLAUDE_IGNORED
        evs = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    second = evs[0]["message"]

    turns = get_trajectory(server, second["id"])["turns"]
    assert [t["completion_id"] for t in turns] == [first["id"], second["id"]]
    [sent_back] = [m for m in turns[1]["request_messages"] if m["role"] == "assistant"]
    assert sent_back["reasoning_content"] == THOUGHT
    assert sent_back["content"] == answer

    def counted(messages: list[dict[str, Any]]) -> int:
        body = {"model": "claude-opus-5-5", "system": first_body["system"], "messages": messages}
        c = httpx.post(f"{url}/count_tokens", json=body, headers=headers, timeout=60)
        assert c.status_code == 200, c.text
        return int(c.json()["input_tokens"])

    without = [*history[:-2], {"role": "assistant", "content": answer}, history[-1]]
    assert counted(history) == counted(without) == second["usage"]["input_tokens"]
