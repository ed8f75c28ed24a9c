"""LangChain over the other two wire protocols against a real rlproxy: a bound tool's call comes
back with its arguments parsed, its result goes back as a ToolMessage, and the two calls are one
trajectory stored with the protocol they came in by.

`ChatOpenAI(use_responses_api=True)` speaks OpenAI's Responses API (`/v1/responses`);
`ChatAnthropic` speaks Anthropic's Messages API (`/v1/messages`, base URL without `/v1`). Both
are configured as their docs show, with nothing of rlproxy's. The tool takes one enum and one
call at a time, so that a forced call fits the budget of the 135M model.
"""

from __future__ import annotations

from typing import Any, Literal

import pytest
from langchain_anthropic import ChatAnthropic
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

from tests.e2e.conftest import Server
from tests.e2e.helpers import get_trajectory

QUESTION = "Look up some geography facts."


@tool
def lookup(topic: Literal["history", "geography", "science"]) -> str:
    """Look up facts about a topic in the encyclopedia."""
    return f"Encyclopedia section {topic!r}: no further details."


def responses_llm(server: Server) -> ChatOpenAI:
    return ChatOpenAI(
        base_url=server.base_url,
        api_key="sk-test",
        model="rlproxy",
        use_responses_api=True,
        temperature=0,
        max_tokens=40,
        max_retries=0,
        timeout=280,
    )


def messages_llm(server: Server) -> ChatAnthropic:
    return ChatAnthropic(
        base_url=server.url,
        api_key="sk-test",
        model="rlproxy",
        temperature=0,
        max_tokens=40,
        max_retries=0,
        timeout=280,
    )


def tool_round_trip(
    llm: BaseChatModel, forced: str | dict[str, Any]
) -> tuple[AIMessage, AIMessage]:
    """A forced call of `lookup`, its result sent back, and the answer to it (tool_choice auto)."""
    history: list[BaseMessage] = [HumanMessage(QUESTION)]
    call = llm.bind_tools([lookup], tool_choice=forced, parallel_tool_calls=False).invoke(history)
    assert isinstance(call, AIMessage)
    assert [c["name"] for c in call.tool_calls] == ["lookup"], call
    [tool_call] = call.tool_calls
    assert tool_call["args"] in ({"topic": t} for t in ("history", "geography", "science"))
    assert isinstance(tool_call["id"], str) and tool_call["id"]
    history += [call, ToolMessage(lookup.invoke(tool_call["args"]), tool_call_id=tool_call["id"])]
    answer = llm.bind_tools([lookup], max_tokens=16).invoke(history)
    assert isinstance(answer, AIMessage)
    return call, answer


def assert_one_trajectory(server: Server, ids: list[str], protocol: str) -> None:
    """Both calls in one trajectory, in order, by the ids their client received."""
    trajectory = get_trajectory(server, ids[0])
    assert trajectory["id"] == get_trajectory(server, ids[1])["id"]
    turns = trajectory["turns"]
    assert [t["completion_id"] for t in turns] == ids
    assert [t["protocol"] for t in turns] == [protocol, protocol]
    first, second = turns
    assert first["request_messages"] == [{"role": "user", "content": QUESTION}]
    [call] = first["response_messages"][0]["tool_calls"]
    assert second["request_messages"][0] == first["request_messages"][0]
    assert [c["id"] for c in second["request_messages"][1]["tool_calls"]] == [call["id"]]
    assert second["request_messages"][2]["role"] == "tool"
    assert second["request_messages"][2]["tool_call_id"] == call["id"]


def test_responses_api_tool_call_and_result(server: Server) -> None:
    call, answer = tool_round_trip(responses_llm(server), "required")
    # The call is a function_call output item; its id is the response's.
    assert call.response_metadata["status"] == "completed"
    assert [b["type"] for b in call.content if isinstance(b, dict)] == ["function_call"]
    assert call.id is not None and call.id.startswith("resp_")
    assert answer.id is not None and answer.id.startswith("resp_")
    assert_one_trajectory(server, [call.id, answer.id], "responses")


def test_messages_api_tool_call_and_result(server: Server) -> None:
    call, answer = tool_round_trip(messages_llm(server), "any")
    assert call.response_metadata["stop_reason"] == "tool_use"
    assert [b["type"] for b in call.content if isinstance(b, dict)] == ["tool_use"]
    assert answer.response_metadata["stop_reason"] in ("end_turn", "max_tokens", "tool_use")
    ids = [call.response_metadata["id"], answer.response_metadata["id"]]
    assert all(i.startswith("msg_") for i in ids), ids
    assert_one_trajectory(server, ids, "messages")


@pytest.mark.parametrize("make_llm", [responses_llm, messages_llm], ids=["responses", "messages"])
def test_streamed_text_matches_invoke(server: Server, make_llm: Any) -> None:
    """Streaming over either protocol gives the text invoke gives (greedy, same budget)."""
    llm = make_llm(server).bind(max_tokens=10)
    message = llm.invoke("Write a long story about a dragon.")
    chunks = list(llm.stream("Write a long story about a dragon."))
    assert message.text and message.text == "".join(c.text for c in chunks)
