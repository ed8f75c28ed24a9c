"""A call's session lane (`proxy.chat.sessions`): the coding agent's session header, and which
agent of the session sent it, as the headers Claude Code 2.1, Codex, OpenCode and pi send them;
and the lane reaching the call record (`proxy.chat.record.call_record`)."""

from __future__ import annotations

from proxy.chat.record import CallInfo, call_record
from proxy.chat.sessions import SESSION_HEADERS, SessionLane, session_lane
from proxy.protocols.chat import ChatCompletionRequest

CLAUDE = "x-claude-code-session-id"


def test_without_a_session_header_there_is_no_lane() -> None:
    assert session_lane({}) is None
    assert session_lane({"x-claude-code-agent-id": "a1", "thread-id": "t"}) is None
    assert session_lane({CLAUDE: ""}) is None


def test_every_call_of_one_agent_of_a_session_has_one_lane() -> None:
    main = session_lane({CLAUDE: "s-1"})
    assert main is not None and main.parent is None
    assert session_lane({CLAUDE: "s-1"}) == main
    assert session_lane({CLAUDE: "s-2"}) != main
    for header in SESSION_HEADERS:
        lane = session_lane({header: "s-1"})
        assert lane is not None and lane.parent is None
    # The first session header found wins (OpenCode sends two).
    both = {"x-session-affinity": "s-1", "x-session-id": "other"}
    assert session_lane(both) == session_lane({"x-session-affinity": "s-1"})
    # Claude Code's and Codex's headers with the same value are different sessions.
    assert session_lane({CLAUDE: "s"}) != session_lane({"session-id": "s"})


def test_a_claude_code_sub_agent_has_its_own_lane_under_the_main_one() -> None:
    main = session_lane({CLAUDE: "s-1"})
    a = session_lane({CLAUDE: "s-1", "x-claude-code-agent-id": "agent-a"})
    b = session_lane({CLAUDE: "s-1", "x-claude-code-agent-id": "agent-b"})
    assert main is not None and a is not None and b is not None
    assert len({main.lane, a.lane, b.lane}) == 3
    assert a.parent == main.lane and b.parent == main.lane
    # A nested sub-agent names the agent that started it.
    nested = session_lane(
        {
            CLAUDE: "s-1",
            "x-claude-code-agent-id": "agent-c",
            "x-claude-code-parent-agent-id": "agent-a",
        }
    )
    assert nested is not None and nested.parent == a.lane


def test_codex_threads_are_lanes_of_their_session() -> None:
    main = session_lane({"session-id": "s-1", "thread-id": "t-main"})
    sub = session_lane({"session-id": "s-1", "thread-id": "t-sub"})
    assert main is not None and sub is not None and main.lane != sub.lane
    assert sub.parent is None  # Codex names no parent thread


def test_a_lane_carries_no_header_value() -> None:
    secret = "sk-live-123456"
    lane = session_lane({CLAUDE: secret, "x-claude-code-agent-id": secret})
    assert lane is not None and secret not in lane.lane and secret not in (lane.parent or "")


def test_the_call_record_carries_the_lanes() -> None:
    request = ChatCompletionRequest.model_validate(
        {"model": "rlproxy", "messages": [{"role": "user", "content": "hi"}]}
    )
    headers = {"X-Claude-Code-Session-Id": "s-1", "X-Claude-Code-Agent-Id": "agent-a"}
    record = call_record(CallInfo(request, "req", headers), engine="local", status="completed")
    expected = session_lane({CLAUDE: "s-1", "x-claude-code-agent-id": "agent-a"})
    assert expected == SessionLane(record.session_lane or "", record.parent_lane)
    plain = call_record(CallInfo(request, "req", {}), engine="local", status="completed")
    assert (plain.session_lane, plain.parent_lane) == (None, None)
