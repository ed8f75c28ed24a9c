"""A turn whose tool call the client rewrote still continues its trajectory, on every protocol.

Seen in CI with the OpenCode CLI: the answer was a tool call cut by the token budget (arguments
`{"file`, not JSON). OpenCode sends the history back with that call rewritten: the same id, but
its `invalid` tool as the name and new arguments, then a tool message with the error. The
name-and-arguments chain no longer matches, so the linker's second key (the request before the
answer plus the answer's tool-call ids, `storage.linking`) must find the trajectory, on Chat
Completions, Messages (`tool_use` id) and Responses (`call_id`), streamed or not. Each protocol
gives the client the id rlproxy stored, and the client sends that id back. The trainer trains
the two turns in rows of their own (`trainer.packing`): the rewritten call is not what was
sampled.

The ids alone are never enough: with a provider that names every call alike (the fake upstream
answers `call_fake_1` each time, as servers that number calls `call_0`, `call_1` do), two
conversations with different earlier messages stay apart, and a history that echoes a stored
answer exactly still goes where the ordinary chain says, even where a newer trajectory has the
same ids at the same place.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest
from openai import OpenAI

from tests.e2e.conftest import Server, free_port
from tests.e2e.fake_openai import FakeOpenAI, FakeOpenAIServer
from tests.e2e.helpers import calls_of, get_trajectory, own_server
from trainer.grpo import TrainingExample
from trainer.packing import pack_turns

SYSTEM = "You are a coding agent. Use the tools."
ASK = "Show me README.md"
CUT = 18
"""Tokens that cut the forced `read_file` call inside its arguments (greedy): `{"file`."""
INVALID_ARGS = {"tool": "read_file", "error": "Invalid input: expected valid JSON arguments"}
TOOL_ERROR = "The arguments provided to the tool are invalid: expected valid JSON arguments"

READ_FILE = {
    "name": "read_file",
    "description": "Read a file.",
    "parameters": {
        "type": "object",
        "properties": {"filePath": {"type": "string"}},
        "required": ["filePath"],
    },
}
INVALID = {
    "name": "invalid",
    "description": "Do not use.",
    "parameters": {
        "type": "object",
        "properties": {"tool": {"type": "string"}, "error": {"type": "string"}},
        "required": ["tool", "error"],
    },
}
CHAT_TOOLS = [{"type": "function", "function": t} for t in (READ_FILE, INVALID)]


def _completion_ids(server: Server, completion_id: str) -> list[str]:
    return [t["completion_id"] for t in get_trajectory(server, completion_id)["turns"]]


def _stored_and_resent_ids(turns: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """The ids stored with the first turn's answer, and those the second turn's request sent."""
    [answer] = turns[0]["response_messages"]
    [resent] = [m for m in turns[1]["request_messages"] if m["role"] == "assistant"]
    return [c["id"] for c in answer["tool_calls"]], [c["id"] for c in resent["tool_calls"]]


# ------------------------------------------------------------- the local model, three protocols


@pytest.mark.parametrize("stream", [False, True])
def test_chat_a_rewritten_tool_call_and_its_error_stay_one_trajectory(
    client: OpenAI, server: Server, stream: bool
) -> None:
    ask = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ASK}]
    request: dict[str, Any] = {"model": "rlproxy", "tools": CHAT_TOOLS, "temperature": 0}
    forced = {"type": "function", "function": {"name": "read_file"}}
    if stream:
        # (not the SDK's `stream` helper: it raises on a cut answer, which is the point here)
        chunks = list(
            client.chat.completions.create(
                messages=ask, tool_choice=forced, max_tokens=CUT, stream=True, **request
            )
        )
        first_id = chunks[0].id
        deltas = [choice for c in chunks for choice in c.choices]
        finish = next(d.finish_reason for d in deltas if d.finish_reason)
        heads = [t for d in deltas for t in d.delta.tool_calls or [] if t.id]
        assert len(heads) == 1 and heads[0].function is not None
        call_id, name = heads[0].id, heads[0].function.name
    else:
        first = client.chat.completions.create(
            messages=ask, tool_choice=forced, max_tokens=CUT, **request
        )
        first_id, finish = first.id, first.choices[0].finish_reason
        [cut] = first.choices[0].message.tool_calls or []
        call_id, name = cut.id, cut.function.name
    assert (finish, name) == ("length", "read_file")

    # OpenCode's resend: the same id, its `invalid` tool and new arguments, then the error.
    rewritten = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": "invalid", "arguments": json.dumps(INVALID_ARGS)},
            }
        ],
    }
    history = [*ask, rewritten, {"role": "tool", "tool_call_id": call_id, "content": TOOL_ERROR}]
    second = client.chat.completions.create(messages=history, max_tokens=4, **request)

    trajectory = get_trajectory(server, second.id)
    turns = trajectory["turns"]
    assert [t["completion_id"] for t in turns] == [first_id, second.id]
    assert _stored_and_resent_ids(turns) == ([call_id], [call_id])

    # What the trainer makes of it: the second prompt repeats the first, but holds the
    # rewritten call where the sampled tokens were, so packing keeps a row per turn.
    calls = calls_of(server.data_dir, trajectory["id"])
    (p1, c1), (p2, _) = [
        (c["prompt_token_ids"], c["choices"][0]["completion_token_ids"]) for c in calls
    ]
    assert p2[: len(p1)] == p1 and p2[len(p1) : len(p1) + len(c1)] != c1
    examples = [
        TrainingExample("s", c["prompt_token_ids"], ids, [0.0] * len(ids), 1.0)
        for c in calls
        for ids in [c["choices"][0]["completion_token_ids"]]
    ]
    assert pack_turns(examples, max_len=100_000) == examples


def test_messages_a_rewritten_tool_use_stays_one_trajectory(server: Server) -> None:
    tools = [
        {"name": t["name"], "description": t["description"], "input_schema": t["parameters"]}
        for t in (READ_FILE, INVALID)
    ]
    ask = [{"role": "user", "content": ASK}]
    with anthropic.Anthropic(base_url=server.url, api_key="sk-test", max_retries=0) as claude:
        first = claude.messages.create(
            model="rlproxy",
            max_tokens=CUT,
            system=SYSTEM,
            messages=ask,
            tools=tools,
            tool_choice={"type": "tool", "name": "read_file"},
            extra_body={"temperature": 0},
        )
        assert first.usage.output_tokens == CUT  # cut inside the input
        [use] = [b for b in first.content if b.type == "tool_use"]
        assert use.name == "read_file"
        second = claude.messages.create(
            model="rlproxy",
            max_tokens=4,
            system=SYSTEM,
            tools=tools,
            messages=[
                *ask,
                {
                    "role": "assistant",
                    "content": [
                        {"type": "tool_use", "id": use.id, "name": "invalid", "input": INVALID_ARGS}
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": use.id,
                            "content": TOOL_ERROR,
                            "is_error": True,
                        }
                    ],
                },
            ],
            extra_body={"temperature": 0},
        )

    turns = get_trajectory(server, second.id)["turns"]
    assert [t["completion_id"] for t in turns] == [first.id, second.id]
    # the id stored with the answer is the id the client got and sent back
    assert _stored_and_resent_ids(turns) == ([use.id], [use.id])


@pytest.mark.parametrize("stream", [False, True])
def test_responses_a_rewritten_function_call_stays_one_trajectory(
    client: OpenAI, server: Server, stream: bool
) -> None:
    tools = [{"type": "function", **t} for t in (READ_FILE, INVALID)]
    history: list[Any] = [{"role": "user", "content": ASK}]
    request: dict[str, Any] = {"model": "rlproxy", "instructions": SYSTEM, "tools": tools}
    forced: Any = {"type": "function", "name": "read_file"}
    if stream:
        # (not the SDK's `stream` helper: it wants `response.completed`; a cut answer ends
        # with `response.incomplete`)
        events = list(
            client.responses.create(
                input=history,
                tool_choice=forced,
                max_output_tokens=CUT,
                temperature=0,
                stream=True,
                **request,
            )
        )
        assert events[-1].type == "response.incomplete"
        first = events[-1].response
    else:
        first = client.responses.create(
            input=history, tool_choice=forced, max_output_tokens=CUT, temperature=0, **request
        )
    assert first.status == "incomplete"
    [call] = [o for o in first.output if o.type == "function_call"]
    assert call.name == "read_file"

    history += [
        {
            "type": "function_call",
            "call_id": call.call_id,
            "name": "invalid",
            "arguments": json.dumps(INVALID_ARGS),
        },
        {"type": "function_call_output", "call_id": call.call_id, "output": TOOL_ERROR},
    ]
    second = client.responses.create(input=history, max_output_tokens=4, **request)

    turns = get_trajectory(server, second.id)["turns"]
    assert [t["completion_id"] for t in turns] == [first.id, second.id]
    assert _stored_and_resent_ids(turns) == ([call.call_id], [call.call_id])


# ------------------------------------------------- a provider that names every call alike


@pytest.fixture(scope="module")
def fake() -> Iterator[FakeOpenAI]:
    with FakeOpenAIServer(free_port()) as fake:
        yield fake


@pytest.fixture(scope="module")
def upstream(
    tmp_path_factory: pytest.TempPathFactory, model_data_dir: Path, fake: FakeOpenAI
) -> Iterator[Server]:
    models = {"teacher": {"model": "openai/fake-model", "api_base": fake.base_url}}
    env = {"RLPROXY_UPSTREAM_MODELS": json.dumps(models), "OPENAI_API_KEY": "sk-fake"}
    with own_server(tmp_path_factory.mktemp("same-ids-data"), model_data_dir, env) as server:
        yield server


@pytest.fixture(scope="module")
def teacher(upstream: Server) -> Iterator[OpenAI]:
    with OpenAI(base_url=upstream.base_url, api_key="sk-test", max_retries=0, timeout=60) as c:
        yield c


def _tools(*names: str) -> list[dict[str, Any]]:
    return [
        {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
        for n in names
    ]


def _rewritten(call_id: str) -> list[dict[str, Any]]:
    """The assistant turn rewritten to `invalid` with `call_id` kept, and the tool's error."""
    calls = [
        {
            "id": call_id,
            "type": "function",
            "function": {"name": "invalid", "arguments": json.dumps(INVALID_ARGS)},
        }
    ]
    return [
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": call_id, "content": TOOL_ERROR},
    ]


def test_the_same_ids_after_different_messages_never_link(
    teacher: OpenAI, upstream: Server
) -> None:
    task_a = [{"role": "user", "content": "Fix the failing test in parser.py"}]
    task_b = [{"role": "user", "content": "Add a --verbose flag to the CLI"}]
    first_a = teacher.chat.completions.create(model="teacher", messages=task_a, tools=_tools("s"))
    first_b = teacher.chat.completions.create(model="teacher", messages=task_b, tools=_tools("s"))
    [call_a] = first_a.choices[0].message.tool_calls or []
    [call_b] = first_b.choices[0].message.tool_calls or []
    assert call_a.id == call_b.id  # the provider's one id for every call

    # B goes on with its call rewritten: it continues B, not A (same ids, other history).
    second_b = teacher.chat.completions.create(
        model="teacher", messages=[*task_b, *_rewritten(call_b.id)], tools=_tools("s")
    )
    assert _completion_ids(upstream, second_b.id) == [first_b.id, second_b.id]
    assert _completion_ids(upstream, first_a.id) == [first_a.id]

    # A conversation no stored turn began, with the same id at the same place: its own.
    task_c = [{"role": "user", "content": "Rename the module utils.py"}]
    other = teacher.chat.completions.create(
        model="teacher", messages=[*task_c, *_rewritten(call_a.id)], tools=_tools("s")
    )
    assert _completion_ids(upstream, other.id) == [other.id]
    assert _completion_ids(upstream, first_a.id) == [first_a.id]


def test_the_ordinary_chain_wins_over_tool_call_ids(teacher: OpenAI, upstream: Server) -> None:
    """Two runs of one request, answered with the same id but different tools (the fake calls
    the first tool it is given): the newer run has the same ids at the same place, yet the
    history that echoes the older run's answer exactly continues the older run."""
    task = [{"role": "user", "content": "Search the docs for the config format"}]
    older = teacher.chat.completions.create(
        model="teacher", messages=task, tools=_tools("search", "lookup")
    )
    newer = teacher.chat.completions.create(
        model="teacher", messages=task, tools=_tools("lookup", "search")
    )
    [call] = older.choices[0].message.tool_calls or []
    [newer_call] = newer.choices[0].message.tool_calls or []
    assert (call.function.name, newer_call.function.name) == ("search", "lookup")
    assert newer_call.id == call.id
    assert _completion_ids(upstream, newer.id) == [newer.id]  # a second run, not a retry

    echoed = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": "search", "arguments": call.function.arguments},
            }
        ],
    }
    result = {"role": "tool", "tool_call_id": call.id, "content": "config.toml"}
    nxt = teacher.chat.completions.create(
        model="teacher", messages=[*task, echoed, result], tools=_tools("search", "lookup")
    )
    assert _completion_ids(upstream, nxt.id) == [older.id, nxt.id]
    assert _completion_ids(upstream, newer.id) == [newer.id]
