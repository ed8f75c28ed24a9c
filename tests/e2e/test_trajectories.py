"""Trajectories stitched from real agents' calls, checked through /rl and in the SQLite file.

A LangChain tool-calling agent sends its whole history on every call and no ids at all; the
proxy must put its calls, in order, into one trajectory. Tool rounds use tool_choice="required"
so that the 135M model calls a tool every round; the tool takes one enum and is bound strictly
(no extra keys) so that every call fits in max_tokens. Each test isolates its trajectories with
the `since` filter (tests in a module run one after another on the module's own server).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import pytest
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from openai import OpenAI

from tests.e2e.conftest import Server
from tests.e2e.helpers import (
    MESSAGE_LIKE,
    calls_of,
    db_rows,
    get_trajectory,
    list_trajectories,
    own_server,
)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

SYSTEM = "You are a research assistant. Use the lookup tool to find facts."
TOOL_ROUNDS = 3


@tool
def lookup(topic: Literal["history", "geography", "science", "literature"]) -> str:
    """Look up facts about a topic in the encyclopedia."""
    # An enum keeps the forced calls short: a free-text argument can run past max_tokens.
    return f"Encyclopedia section {topic!r}: no further details."


@pytest.fixture(scope="module")
def traj_server(tmp_path_factory: pytest.TempPathFactory, model_data_dir: Path) -> Iterator[Server]:
    with own_server(tmp_path_factory.mktemp("traj-data"), model_data_dir) as server:
        yield server


def _llm(server: Server, **kw: Any) -> ChatOpenAI:
    # Its own async HTTP client: langchain-openai caches a default one across calls, and a
    # client from an earlier test's (closed) event loop fails with "Event loop is closed".
    return ChatOpenAI(
        http_async_client=httpx.AsyncClient(timeout=300),
        base_url=server.base_url,
        api_key="sk-test",
        model="rlproxy",
        temperature=0,
        max_tokens=60,
        max_retries=0,
        timeout=300,
        **kw,
    )


async def run_agent(llm: ChatOpenAI, question: str) -> list[BaseMessage]:
    """Three forced tool rounds, then a final answer with tools off. Returns the history."""
    history: list[BaseMessage] = [SystemMessage(SYSTEM), HumanMessage(question)]
    forced = llm.bind_tools(
        [lookup], tool_choice="required", parallel_tool_calls=False, strict=True
    )
    for _ in range(TOOL_ROUNDS):
        reply = await forced.ainvoke(history)
        assert isinstance(reply, AIMessage) and reply.tool_calls, reply
        history.append(reply)
        for call in reply.tool_calls:
            result = lookup.invoke(call["args"])
            history.append(ToolMessage(str(result), tool_call_id=call["id"]))
    final = await llm.bind_tools([lookup], tool_choice="none").ainvoke(history)
    history.append(final)
    return history


def _check_one_agent_trajectory(server: Server, trajectory_id: str, question: str) -> None:
    detail = get_trajectory(server, trajectory_id)
    turns = detail["turns"]
    assert detail["turn_count"] == TOOL_ROUNDS + 1 == len(turns)
    assert [t["turn_index"] for t in turns] == list(range(TOOL_ROUNDS + 1))
    for i, turn in enumerate(turns):
        user = [m for m in turn["request_messages"] if m["role"] == "user"]
        assert user[0]["content"] == question
        # turn i sends system + question + i rounds of (assistant tool call, tool result)
        assert len(turn["request_messages"]) == 2 + 2 * i
        assert turn["status"] == "completed" and turn["attempts"] == 1
        assert turn["prompt_tokens"] and turn["completion_tokens"]
        assert turn["adapter_version"] is None
        assert turn["response_messages"]
    for turn in turns[:TOOL_ROUNDS]:
        assert turn["response_messages"][0]["tool_calls"]
    # Straight from the database: exact token ids stored for every call.
    calls = calls_of(server.data_dir, trajectory_id)
    assert [c["turn_index"] for c in calls] == list(range(TOOL_ROUNDS + 1))
    for call in calls:
        assert call["engine"] == "local"
        assert call["prompt_token_ids"] and all(
            isinstance(t, int) for t in call["prompt_token_ids"]
        )
        assert call["choices"][0]["completion_token_ids"]
        assert call["prompt_tokens"] == len(call["prompt_token_ids"])


async def test_langchain_agent_without_ids_is_one_trajectory(traj_server: Server) -> None:
    since = time.time() - 1
    question = "Who wrote the novel Dracula?"
    await run_agent(_llm(traj_server), question)
    items = list_trajectories(traj_server, since=since)
    assert len(items) == 1, items
    assert items[0]["status"] == "open" and not items[0]["explicit"]
    assert items[0]["call_count"] == TOOL_ROUNDS + 1
    _check_one_agent_trajectory(traj_server, items[0]["id"], question)


async def test_two_concurrent_agents_are_two_trajectories(traj_server: Server) -> None:
    since = time.time() - 1
    questions = ["What is the capital of Peru?", "How tall is Mount Everest?"]
    llm = _llm(traj_server)
    await asyncio.gather(*(run_agent(llm, q) for q in questions))
    items = list_trajectories(traj_server, since=since)
    assert len(items) == 2, items
    by_question = {}
    for item in items:
        detail = get_trajectory(traj_server, item["id"])
        first_user = next(m for m in detail["turns"][0]["request_messages"] if m["role"] == "user")
        by_question[first_user["content"]] = item["id"]
    assert set(by_question) == set(questions)
    for question, trajectory_id in by_question.items():
        _check_one_agent_trajectory(traj_server, trajectory_id, question)


def _chat(client: OpenAI, messages: list[dict[str, Any]], **kw: Any) -> dict[str, Any]:
    reply = client.chat.completions.create(
        model="rlproxy", messages=messages, max_tokens=8, temperature=0, **kw
    )
    return reply.choices[0].message.model_dump(exclude_none=True)


def test_explicit_id_overrides_matching(traj_server: Server) -> None:
    since = time.time() - 1
    header_id = f"explicit-header-{uuid.uuid4().hex[:8]}"
    meta_id = f"explicit-meta-{uuid.uuid4().hex[:8]}"
    client = OpenAI(base_url=traj_server.base_url, api_key="sk-test", max_retries=0, timeout=300)
    first = [{"role": "user", "content": "Name a colour."}]
    answer = _chat(client, first)  # no id: opens an implicit trajectory
    follow_up = [*first, answer, {"role": "user", "content": "Another one?"}]
    # Matching would append this to the implicit trajectory; the header sends it elsewhere.
    _chat(client, follow_up, extra_headers={"X-RLProxy-Trajectory": header_id})
    # Two unrelated conversations with the same metadata id form one trajectory.
    _chat(
        client,
        [{"role": "user", "content": "Count to three."}],
        metadata={"trajectory_id": meta_id},
    )
    _chat(client, [{"role": "user", "content": "Say hello."}], metadata={"trajectory_id": meta_id})
    # LangChain's default_headers carry the header on every call of a model object.
    header_llm = _llm(traj_server, default_headers={"X-RLProxy-Trajectory": header_id})
    header_llm.bind(max_tokens=8).invoke("Unrelated question about cats.")

    items = {i["id"]: i for i in list_trajectories(traj_server, since=since)}
    assert items[header_id]["explicit"] and items[header_id]["turn_count"] == 2
    assert items[meta_id]["explicit"] and items[meta_id]["turn_count"] == 2
    implicit = [i for i in items.values() if not i["explicit"]]
    assert len(implicit) == 1 and implicit[0]["turn_count"] == 1
    assert len(items) == 3


def test_retried_call_does_not_fork(traj_server: Server) -> None:
    since = time.time() - 1
    client = OpenAI(base_url=traj_server.base_url, api_key="sk-test", max_retries=0, timeout=300)
    first = [{"role": "user", "content": "Name a fruit."}]
    answer = _chat(client, first)
    second = [*first, answer, {"role": "user", "content": "And a vegetable?"}]
    _chat(client, second)
    # The SDK marks its own retries with x-stainless-retry-count; send one by hand.
    answer2 = _chat(client, second, extra_headers={"x-stainless-retry-count": "1"})
    third = [*second, answer2, {"role": "user", "content": "And a colour?"}]
    # A client without that header gives up (timeout) and resends right away: a retry too.
    # Temperature 2 all but never samples the end token: this generation outlasts the timeout.
    slow = {
        "model": "rlproxy",
        "messages": third,
        "max_tokens": 2000,
        "temperature": 2.0,
        "seed": 1,
    }
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{traj_server.base_url}/chat/completions", json=slow, timeout=1.0)
    _chat(client, third)

    items = list_trajectories(traj_server, since=since)
    assert len(items) == 1, items
    assert items[0]["turn_count"] == 3 and items[0]["call_count"] == 5
    turns = get_trajectory(traj_server, items[0]["id"])["turns"]
    assert [t["attempts"] for t in turns] == [1, 2, 2]
    assert turns[1]["retry_of"] is not None and turns[2]["retry_of"] is not None
    calls = calls_of(traj_server.data_dir, items[0]["id"])
    assert [c["turn_index"] for c in calls] == [0, 1, 1, 2, 2]
    assert sorted(c["status"] for c in calls if c["turn_index"] == 2) == [
        "client_disconnected",
        "completed",
    ]


@pytest.mark.parametrize("stream", [False, True])
def test_a_negative_retry_header_is_no_retry_and_the_call_is_stored(
    traj_server: Server, stream: bool
) -> None:
    """`x-stainless-retry-count: -1` is the client's mistake, not a reason to lose the call: the
    call answers 200 and is stored with retry count 0, streamed or not, as upstream calls are."""
    marker = f"Say the word {uuid.uuid4().hex[:8]}."
    body = {
        "model": "rlproxy",
        "messages": [{"role": "user", "content": marker}],
        "max_tokens": 4,
        "stream": stream,
    }
    headers = {"x-stainless-retry-count": "-1"}
    response = httpx.post(
        f"{traj_server.base_url}/chat/completions", json=body, headers=headers, timeout=120
    )
    assert response.status_code == 200, response.text
    if stream:
        assert response.text.rstrip().endswith("data: [DONE]")
        assert '"error"' not in response.text
    rows = db_rows(
        traj_server.data_dir,
        f"SELECT status, retry_count FROM calls WHERE {MESSAGE_LIKE}",
        (f"%{marker}%",),
    )
    assert [(r["status"], r["retry_count"]) for r in rows] == [("completed", 0)]
