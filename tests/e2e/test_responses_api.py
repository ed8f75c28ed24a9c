"""OpenAI's Responses API against a real rlproxy, with the openai SDK as its docs show it.

`client.responses.create`, `.stream`, `.retrieve`, `.delete`, `.input_items.list`, a
`previous_response_id` chain through a function call and its output, `store: false`, structured
output, logprobs, Codex's `namespace` and hosted tools, and the errors. What is checked are
protocol properties (shapes, event order, what is stored and linked), not answers: the model has
135M parameters.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from openai import BadRequestError, NotFoundError, OpenAI

from tests.e2e.conftest import Server
from tests.e2e.helpers import get_trajectory, typed_events

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
TIME = {
    "type": "function",
    "name": "get_time",
    "description": "The time in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}


# What every answer names as its model: the version that served it (the shared server's policy
# serves the base model).
SERVED = "rlproxy@base"


def events(server: Server, body: dict[str, Any]) -> list[dict[str, Any]]:
    return typed_events(f"{server.base_url}/responses", body)


@pytest.fixture(scope="module")
def greedy_response(client: OpenAI):
    return client.responses.create(
        model="rlproxy", input="Say hello to Bob.", max_output_tokens=12, temperature=0
    )


def test_create_returns_a_response_object(greedy_response) -> None:
    r = greedy_response
    assert r.id.startswith("resp_")
    assert r.object == "response"
    assert r.status in ("completed", "incomplete")
    assert r.model == SERVED
    [message] = r.output
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text"
    assert r.output_text == message.content[0].text and r.output_text
    assert r.usage is not None and r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if r.status == "incomplete":
        assert r.usage.output_tokens == 12
        assert r.incomplete_details is not None
        assert r.incomplete_details.reason == "max_output_tokens"


def test_retrieve_returns_what_create_returned(client: OpenAI, greedy_response) -> None:
    again = client.responses.retrieve(greedy_response.id)
    assert again.model_dump() == greedy_response.model_dump()


def test_input_items_list_the_input(client: OpenAI, greedy_response) -> None:
    items = client.responses.input_items.list(greedy_response.id, order="asc")
    [item] = items.data
    assert item.type == "message" and item.role == "user"
    assert item.content[0].text == "Say hello to Bob."


def test_stream_events_in_order_and_equal_to_create(server: Server, greedy_response) -> None:
    evs = events(
        server,
        {
            "model": "rlproxy",
            "input": "Say hello to Bob.",
            "max_output_tokens": 12,
            "temperature": 0,
        },
    )
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    kinds = [e["type"] for e in evs]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    last = "response.completed" if greedy_response.status == "completed" else "response.incomplete"
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        last,
    ]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    text = "".join(e["delta"] for e in evs if e["type"] == "response.output_text.delta")
    assert text == greedy_response.output_text
    final = evs[-1]["response"]
    assert {e["response"]["model"] for e in evs if "response" in e} == {SERVED}
    assert final["output"][0]["content"][0]["text"] == text
    assert final["usage"]["output_tokens"] == greedy_response.usage.output_tokens
    assert evs[0]["response"]["status"] == "in_progress"


def test_sdk_stream_helper(client: OpenAI) -> None:
    with client.responses.stream(
        model="rlproxy", input="Say hi.", max_output_tokens=200, temperature=0
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed"
    assert final.output_text == "".join(deltas)


@pytest.mark.parametrize("stream", [False, True])
def test_the_answer_names_the_version_that_served_it(client: OpenAI, stream: bool) -> None:
    raw = client.responses.with_raw_response.create(
        model="gpt-4o-mini", input="Say hi.", max_output_tokens=2, stream=stream
    )
    assert raw.headers["x-rlproxy-version"] == "base"
    answer = raw.parse()
    responses = [e.response for e in answer if hasattr(e, "response")] if stream else [answer]
    assert {r.model for r in responses} == {SERVED}


def test_max_output_tokens_ends_incomplete(server: Server) -> None:
    evs = events(
        server, {"model": "rlproxy", "input": "Write a long story.", "max_output_tokens": 3}
    )
    assert evs[-1]["type"] == "response.incomplete"
    assert evs[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_function_call_chain_is_one_trajectory(client: OpenAI, server: Server) -> None:
    first = client.responses.create(
        model="rlproxy",
        instructions="You answer questions about the weather.",
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=64,
        temperature=0,  # sampled, a long argument can run past 64 tokens and cut the call
    )
    [call] = [o for o in first.output if o.type == "function_call"]
    assert call.name == "get_weather" and call.id.startswith("fc_")
    assert "city" in json.loads(call.arguments)
    second = client.responses.create(
        model="rlproxy",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}],
        tools=[WEATHER],
        max_output_tokens=16,
    )
    assert second.previous_response_id == first.id
    [own] = client.responses.input_items.list(second.id).data
    assert own.type == "function_call_output" and own.call_id == call.call_id

    trajectory = get_trajectory(server, second.id)  # a response id names its trajectory
    assert trajectory["id"] == get_trajectory(server, first.id)["id"]
    turns = trajectory["turns"]
    assert [t["completion_id"] for t in turns] == [first.id, second.id]
    assert {t["protocol"] for t in turns} == {"responses"}
    # the second turn's request: the first's conversation, its call, then the call's output
    roles = [m["role"] for m in turns[1]["request_messages"]]
    assert roles == ["user", "assistant", "tool"]  # instructions are not carried over
    assert turns[1]["request_messages"][1]["tool_calls"][0]["id"] == call.call_id


def test_a_full_history_without_previous_id_links_by_prefix(client: OpenAI, server: Server) -> None:
    """What the Agents SDK does: every turn resends the whole conversation as items."""
    history: list[Any] = [{"role": "user", "content": "What time is it in Rome?"}]
    first = client.responses.create(
        model="rlproxy",
        input=history,
        tools=[TIME],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=64,
        temperature=0,  # sampled, a long argument can run past 64 tokens and cut the call
    )
    [call] = [o for o in first.output if o.type == "function_call"]
    history += [o.model_dump(exclude_none=True) for o in first.output]
    history.append({"type": "function_call_output", "call_id": call.call_id, "output": "10:00"})
    second = client.responses.create(
        model="rlproxy", input=history, tools=[TIME], max_output_tokens=8
    )
    turns = get_trajectory(server, second.id)["turns"]
    assert [t["completion_id"] for t in turns] == [first.id, second.id]


def test_store_false_is_not_retrievable_but_recorded(client: OpenAI, server: Server) -> None:
    r = client.responses.create(model="rlproxy", input="Hi", max_output_tokens=4, store=False)
    assert r.store is False
    with pytest.raises(NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(NotFoundError):
        client.responses.create(
            model="rlproxy", input="Again", previous_response_id=r.id, max_output_tokens=4
        )
    assert get_trajectory(server, r.id)["turns"][0]["completion_id"] == r.id


def test_delete(client: OpenAI, server: Server) -> None:
    r = client.responses.create(model="rlproxy", input="Hi", max_output_tokens=4)
    client.responses.delete(r.id)
    with pytest.raises(NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(NotFoundError):
        client.responses.delete(r.id)
    assert get_trajectory(server, r.id)["turns"][0]["completion_id"] == r.id  # still trains


def test_structured_output(client: OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    r = client.responses.create(
        model="rlproxy",
        input="Invent a person.",
        text={
            "format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}
        },
        max_output_tokens=64,
        # Greedy: sampled at temperature 1, the 135M model writes a name or an integer long
        # enough that 64 tokens cut it about one time in fifteen (status incomplete, and the
        # text is then a JSON prefix, as OpenAI's is).
        temperature=0,
    )
    assert r.status == "completed", r.incomplete_details
    value = json.loads(r.output_text)
    assert set(value) == {"name", "age"} and isinstance(value["age"], int)
    assert r.text.format.type == "json_schema"


def test_logprobs_included(client: OpenAI) -> None:
    r = client.responses.create(
        model="rlproxy",
        input="Say hi.",
        max_output_tokens=5,
        include=["message.output_text.logprobs"],
        top_logprobs=2,
    )
    logprobs = r.output[0].content[0].logprobs
    assert logprobs is not None and len(logprobs) == r.usage.output_tokens
    assert all(len(lp.top_logprobs) == 2 and lp.logprob <= 0 for lp in logprobs)


def test_tool_choice_none_and_named(client: OpenAI) -> None:
    none = client.responses.create(
        model="rlproxy",
        input="Weather in Oslo?",
        tools=[WEATHER, TIME],
        tool_choice="none",
        max_output_tokens=8,
    )
    assert all(o.type == "message" for o in none.output)
    named = client.responses.create(
        model="rlproxy",
        input="Weather in Oslo?",
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "name": "get_time"},
        parallel_tool_calls=False,
        max_output_tokens=64,
        temperature=0,  # sampled, a long argument can run past 64 tokens and cut the call
    )
    assert [o.name for o in named.output if o.type == "function_call"] == ["get_time"]


def test_reward_by_response_id(client: OpenAI, server: Server) -> None:
    r = client.responses.create(model="rlproxy", input="Hi", max_output_tokens=4)
    reward = httpx.post(
        f"{server.url}/rl/trajectories/{r.id}/reward", json={"reward": 1.0, "source": "env"}
    )
    assert reward.status_code == 200, reward.text
    assert get_trajectory(server, r.id)["rewards"][0]["reward"] == 1.0


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "rlproxy", "input": [{"type": "bogus"}]}, "input[0].type"),
        ({"model": "rlproxy", "input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
        (
            {"model": "rlproxy", "input": [{"type": "function_call", "name": "f"}]},
            "input[0].call_id",
        ),
        (
            {"model": "rlproxy", "input": "x", "tools": [{"type": "custom", "name": "patch"}]},
            "tools[0].type",
        ),
        ({"model": "rlproxy", "input": "x", "conversation": "conv_1"}, "conversation"),
        ({"model": "rlproxy", "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x"}, "model"),
    ],
)
def test_bad_input_is_a_400_in_openai_shape(server: Server, body: dict, param: str) -> None:
    r = httpx.post(f"{server.base_url}/responses", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert error["message"]


def test_unknown_ids_are_404(client: OpenAI) -> None:
    with pytest.raises(NotFoundError):
        client.responses.retrieve("resp_does_not_exist")
    with pytest.raises(NotFoundError):
        client.responses.create(
            model="rlproxy", input="x", previous_response_id="resp_nope", max_output_tokens=2
        )
    with pytest.raises(NotFoundError):
        client.responses.input_items.list("chatcmpl-abc")


def test_cancel_is_refused_in_the_foreground(client: OpenAI, greedy_response) -> None:
    with pytest.raises(BadRequestError):
        client.responses.cancel(greedy_response.id)


def test_a_405_names_every_method_of_the_path(server: Server) -> None:
    r = httpx.request("PUT", f"{server.base_url}/responses/resp_x", timeout=30)
    assert r.status_code == 405
    assert r.headers["allow"] == "DELETE, GET"


# ----------------------------------------------------------------------------- Codex


MULTI_AGENT = {
    "type": "namespace",
    "name": "multi_agent_v1",
    "description": "Start and stop sub-agents.",
    "tools": [
        {
            "type": "function",
            "name": "spawn_agent",
            "description": "Start a sub-agent on a task.",
            "parameters": {
                "type": "object",
                "properties": {"task": {"type": "string", "enum": ["say hello"]}},
                "required": ["task"],
            },
            "strict": False,
        },
        {
            "type": "function",
            "name": "close_agent",
            "parameters": {
                "type": "object",
                "properties": {"id": {"type": "string", "enum": ["a1"]}},
                "required": ["id"],
            },
            "strict": False,
        },
    ],
}
WEB_SEARCH = {"type": "web_search", "external_web_access": False}
CODEX_INPUT = [
    {"role": role, "content": [{"type": "input_text", "text": text}]}
    for role, text in (("developer", "Be Codex."), ("user", "Say hello."))
]


def test_codexs_namespace_and_hosted_tools_are_served(client: OpenAI, server: Server) -> None:
    """Codex 0.171.0's request (docs: CODING-AGENTS.md): a `namespace` of functions and a
    `web_search` beside them, no output budget, `store: false`, encrypted reasoning asked for.
    `required` makes the answer a call; its arguments are enums, so it ends in a few tokens."""
    with client.responses.with_streaming_response.create(
        model="rlproxy",
        input=CODEX_INPUT,  # type: ignore[arg-type]
        tools=[MULTI_AGENT, WEB_SEARCH],  # type: ignore[list-item]
        tool_choice="required",
        parallel_tool_calls=False,
        store=False,
        include=["reasoning.encrypted_content"],
        reasoning={"summary": "auto"},
        prompt_cache_key="session-1",
        stream=True,
        extra_body={"client_metadata": {"thread_id": "t"}},
    ) as raw:
        assert raw.headers["x-rlproxy-ignored-tools"] == "web_search"
        assert raw.headers["x-rlproxy-output-budget"].endswith("requested=none")
        events = list(raw.parse())
    [added] = [e for e in events if e.type == "response.output_item.added"]
    assert added.item.type == "function_call"
    assert added.item.namespace == "multi_agent_v1"
    assert added.item.name in ("spawn_agent", "close_agent")
    done = events[-1]
    assert done.type == "response.completed"
    [call] = done.response.output
    assert call.type == "function_call" and call.namespace == "multi_agent_v1"
    [echoed] = done.response.tools  # what the model was offered: the namespace, grouped
    assert echoed.type == "namespace" and [t.name for t in echoed.tools] == [
        "spawn_agent",
        "close_agent",
    ]

    # Codex's next turn resends everything, the call with its namespace, and the call's output.
    second = client.responses.create(
        model="rlproxy",
        input=[
            *CODEX_INPUT,
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "namespace": call.namespace,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "started"},
        ],  # type: ignore[list-item]
        tools=[MULTI_AGENT],  # type: ignore[list-item]
        store=False,
        max_output_tokens=4,
    )
    turns = get_trajectory(server, second.id)["turns"]
    assert [t["completion_id"] for t in turns] == [done.response.id, second.id]


THOUGHT = "The user wants a greeting."
CODEX_IGNORED = "client_metadata, include[reasoning.encrypted_content], reasoning.summary"


def test_codexs_reasoning_is_kept_and_what_it_ignores_is_named(
    client: OpenAI, server: Server
) -> None:
    """Codex's fields on two turns of one conversation. `reasoning.summary`, `include:
    ["reasoning.encrypted_content"]` and `client_metadata` are accepted with no effect and named
    in `X-RLProxy-Ignored-Fields` (non-streamed and streamed); `prompt_cache_key` (the replica
    affinity key) and `store` are not. The second turn sends the first answer back after a
    `reasoning` item, as Codex does: its summary text is kept in the stored turn, its
    `encrypted_content` is named, and the turns are one trajectory."""
    codex: dict[str, Any] = {
        "model": "rlproxy",
        "store": False,
        "include": ["reasoning.encrypted_content"],
        "reasoning": {"summary": "auto"},
        "prompt_cache_key": "session-2",
        "max_output_tokens": 4,
        "extra_body": {"client_metadata": {"thread_id": "t", "turn_id": "1"}},
    }
    raw = client.responses.with_raw_response.create(input=CODEX_INPUT, **codex)  # type: ignore[arg-type]
    assert raw.headers["x-rlproxy-ignored-fields"] == CODEX_IGNORED
    first = raw.parse()

    reasoning = {
        "type": "reasoning",
        "id": "rs_1",
        "summary": [{"type": "summary_text", "text": THOUGHT}],
        "encrypted_content": "gAAAAABp-opaque",
    }
    answer = {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": first.output_text}],
    }
    bye = {"role": "user", "content": [{"type": "input_text", "text": "Say bye."}]}
    with client.responses.with_streaming_response.create(
        input=[*CODEX_INPUT, reasoning, answer, bye],  # type: ignore[list-item]
        stream=True,
        **codex,
    ) as streamed:
        assert streamed.headers["x-rlproxy-ignored-fields"] == (
            "client_metadata, include[reasoning.encrypted_content], "
            "input.reasoning.encrypted_content, reasoning.summary"
        )
        second = list(streamed.parse())[-1].response

    turns = get_trajectory(server, second.id)["turns"]
    assert [t["completion_id"] for t in turns] == [first.id, second.id]
    [sent_back] = [m for m in turns[1]["request_messages"] if m["role"] == "assistant"]
    assert sent_back["reasoning_content"] == THOUGHT
    assert sent_back["content"] == first.output_text
