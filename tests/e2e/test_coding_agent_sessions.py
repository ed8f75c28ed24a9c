"""A coding agent's session against a real rlproxy, with the anthropic SDK sending the headers
Claude Code 2.1 sends: compaction keeps one episode with a recorded boundary, a sub-agent is a
trajectory of its own linked to its parent.

Claude Code sends `X-Claude-Code-Session-Id` on every call of a session, and a sub-agent's calls
add `x-claude-code-agent-id`. When it compacts, it first asks for a summary (the history and a
"respond with text only" message: that call continues the history, so the chain finds it), then
goes on from a rewritten history (the summary, re-read files as `<system-reminder>` text, the
new message), which only the session lane finds (`storage.linking`): the turn is stored with
`history_rewritten`. The same calls without the session header are today's behaviour: the
rewritten history starts a trajectory of its own.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import anthropic
import pytest

from tests.e2e.conftest import Server
from tests.e2e.helpers import get_trajectory, list_trajectories

SYSTEM = "You are Claude Code, a coding agent. Working directory: /tmp/project"
READ = {
    "name": "Read",
    "description": "Read a file.",
    "input_schema": {
        "type": "object",
        "properties": {"file_path": {"type": "string"}},
        "required": ["file_path"],
    },
}
TASK = {
    "name": "Task",
    "description": "Start a sub-agent.",
    "input_schema": {
        "type": "object",
        "properties": {"prompt": {"type": "string"}},
        "required": ["prompt"],
    },
}
SUMMARISE = (
    "CRITICAL: Respond with TEXT ONLY. Do NOT call any tools. Your task is to create a detailed "
    "summary of the conversation so far."
)


@pytest.fixture(scope="module")
def claude(server: Server) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=server.url, api_key="sk-test", max_retries=0) as c:
        yield c


def ask(
    claude: anthropic.Anthropic,
    messages: list[dict[str, Any]],
    headers: dict[str, str],
    *,
    system: str = SYSTEM,
    tools: list[dict[str, Any]] | None = None,
) -> Any:
    """One Claude-Code-shaped call: its system prompt and tools, greedy, text only."""
    return claude.messages.create(
        model="claude-opus-5-5",
        max_tokens=8,
        system=system,
        tools=[READ, TASK] if tools is None else tools,  # type: ignore[arg-type]
        tool_choice={"type": "none"},
        messages=messages,  # type: ignore[arg-type]
        extra_headers=headers,
        extra_body={"temperature": 0},
    )


def text(message: Any) -> str:
    return "".join(b.text for b in message.content if b.type == "text")


def compacted_session(claude: anthropic.Anthropic, headers: dict[str, str]) -> list[Any]:
    """Two turns, the summarisation call, then the rewritten history; each call's answer."""
    history: list[dict[str, Any]] = [{"role": "user", "content": "Fix the failing test."}]
    answers = []
    for follow_up in ("Go on.", SUMMARISE):
        answers.append(ask(claude, history, headers))
        history += [
            {"role": "assistant", "content": answers[-1].content},
            {"role": "user", "content": follow_up},
        ]
    answers.append(ask(claude, history, headers))  # the summary
    rewritten = [
        {
            "role": "user",
            "content": [
                {
                    "type": "text",
                    "text": "This session is being continued from a previous conversation "
                    f"that ran out of context. Summary: {text(answers[-1])}",
                },
                {"type": "text", "text": "<system-reminder>test_x.py: ...</system-reminder>"},
                {"type": "text", "text": "Now run the test."},
            ],
        }
    ]
    answers.append(ask(claude, rewritten, headers))
    return answers


def test_compaction_continues_the_session_with_a_boundary_on_the_rewritten_turn(
    claude: anthropic.Anthropic, server: Server
) -> None:
    headers = {"X-Claude-Code-Session-Id": str(uuid.uuid4())}
    answers = compacted_session(claude, headers)
    trajectory = get_trajectory(server, answers[-1].id)
    turns = trajectory["turns"]
    assert [t["completion_id"] for t in turns] == [a.id for a in answers]
    assert [t["history_rewritten"] for t in turns] == [False, False, False, True]
    assert trajectory["parent_trajectory_id"] is None
    assert trajectory["session_lane"] and headers["X-Claude-Code-Session-Id"] not in str(trajectory)


def test_without_the_session_header_the_rewritten_history_is_a_new_trajectory(
    claude: anthropic.Anthropic, server: Server
) -> None:
    answers = compacted_session(claude, {})
    before = get_trajectory(server, answers[2].id)
    after = get_trajectory(server, answers[3].id)
    assert before["id"] != after["id"] and before["turn_count"] == 3
    assert not any(t["history_rewritten"] for t in before["turns"] + after["turns"])
    assert after["session_lane"] is None and after["parent_trajectory_id"] is None


def test_a_sub_agent_is_its_own_trajectory_linked_to_its_parent(
    claude: anthropic.Anthropic, server: Server
) -> None:
    session = {"X-Claude-Code-Session-Id": str(uuid.uuid4())}
    main = ask(claude, [{"role": "user", "content": "Find the failing test."}], session)
    main_id = get_trajectory(server, main.id)["id"]

    sub = {**session, "x-claude-code-agent-id": "a" + uuid.uuid4().hex[:16]}
    task = [{"role": "user", "content": "Search the repository for failing tests."}]
    search = "You are a search agent for Claude Code."
    first = ask(claude, task, sub, system=search, tools=[READ])
    task += [{"role": "assistant", "content": first.content}]
    task += [{"role": "user", "content": "Go on."}]
    second = ask(claude, task, sub, system=search, tools=[READ])

    sub_trajectory = get_trajectory(server, second.id)
    assert sub_trajectory["id"] != main_id
    assert [t["completion_id"] for t in sub_trajectory["turns"]] == [first.id, second.id]
    assert sub_trajectory["parent_trajectory_id"] == main_id
    assert [t["id"] for t in list_trajectories(server, parent=main_id)] == [sub_trajectory["id"]]
    # The main agent goes on in its own trajectory, by the chain.
    history = [
        {"role": "user", "content": "Find the failing test."},
        {"role": "assistant", "content": main.content},
        {"role": "user", "content": "The sub-agent found tests/test_x.py."},
    ]
    assert get_trajectory(server, ask(claude, history, session).id)["id"] == main_id
