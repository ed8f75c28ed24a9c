"""The conversation key the chat service gives each engine request (`proxy.chat.affinity`):
the same on every turn of one conversation, different between conversations, explicit ids and
coding agents' session headers first."""

from __future__ import annotations

from typing import Any

from proxy.chat.affinity import affinity_key
from proxy.chat.record import CallInfo, RequestDump
from proxy.chat.sessions import SESSION_HEADERS
from proxy.protocols.chat import ChatCompletionRequest
from storage.linking import task_signature

SYSTEM = {"role": "system", "content": "You are a coding agent."}


def call(messages: list[dict[str, Any]], headers: dict[str, str] | None = None, **body: Any) -> Any:
    request = ChatCompletionRequest.model_validate(
        {"model": "rlproxy", "messages": messages, **body}
    )
    return CallInfo(request, "req", headers or {})


def key(messages: list[dict[str, Any]], headers: dict[str, str] | None = None, **body: Any) -> str:
    info = call(messages, headers, **body)
    return affinity_key(info, RequestDump.of(info.request))


def conversation(first: str, turns: int) -> list[list[dict[str, Any]]]:
    """The messages of each turn of one conversation: the history grows, the opening stays."""
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": first}]
    out = [list(messages)]
    for t in range(turns - 1):
        messages += [
            {"role": "assistant", "content": f"answer {t}"},
            {"role": "user", "content": f"next {t}"},
        ]
        out.append(list(messages))
    return out


def test_every_turn_of_a_conversation_has_the_opening_key_and_others_differ() -> None:
    fix = [key(m) for m in conversation("Fix the failing test.", 4)]
    docs = [key(m) for m in conversation("Write the docs.", 3)]
    assert len(set(fix)) == 1 and len(set(docs)) == 1
    assert fix[0] != docs[0] and fix[0].startswith("task:")


def test_without_ids_the_key_is_the_task_signature_grouping_uses() -> None:
    """One hash for "the same task" (`storage.linking.task_signature`): runs of one task share
    a replica, and its tools are part of it."""
    tool = {"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}}
    messages = conversation("Fix the failing test.", 1)[0]
    assert key(messages) == "task:" + task_signature(messages, None)
    assert key(messages, tools=[tool]) == "task:" + task_signature(messages, [tool])
    assert key(messages, tools=[tool]) != key(messages)


def test_an_explicit_trajectory_id_wins_over_headers_and_the_opening() -> None:
    turns = conversation("Fix the failing test.", 2)
    headers = {"X-RLProxy-Trajectory": "run-7", "X-Claude-Code-Session-Id": "abc"}
    keys = {key(m, headers) for m in turns}
    assert len(keys) == 1 and next(iter(keys)).startswith("trajectory:")
    assert key(turns[0], {"X-RLProxy-Trajectory": "run-8"}) not in keys
    assert key(turns[0], metadata={"trajectory_id": "run-7"}) != key(turns[0])


def test_each_coding_agents_session_header_keys_its_session_whatever_the_messages() -> None:
    one, other = conversation("a", 1)[0], conversation("b", 1)[0]
    for header in SESSION_HEADERS:
        same = key(one, {header: "s-1"})
        assert same.startswith("session:")
        assert key(other, {header.upper(): "s-1"}) == same  # header names in any case
        assert key(one, {header: "s-2"}) != same
    # Claude Code's and Codex's headers with the same value are different sessions' keys.
    assert key(one, {"x-claude-code-session-id": "s"}) != key(one, {"session-id": "s"})


def test_a_key_carries_no_text_of_the_request() -> None:
    secret = "sk-live-123456"
    k = key([{"role": "user", "content": secret}], {"session-id": secret})
    assert secret not in k and secret not in key([{"role": "user", "content": secret}])


def test_a_prompt_cache_key_comes_after_the_trajectory_id_and_before_session_headers() -> None:
    """OpenAI's routing hint: requests that share it share a prefix. Codex sends its
    conversation's id (its sub-agents each their own), so it wins over the session header."""
    turns = conversation("Fix the failing test.", 2)
    session = {"session-id": "s-1"}
    cached = {key(m, session, prompt_cache_key="thread-1") for m in turns}
    assert len(cached) == 1 and next(iter(cached)).startswith("cache:")
    assert key(turns[0], session, prompt_cache_key="thread-2") not in cached  # a sub-agent
    assert key(turns[0], session) != key(turns[0], session, prompt_cache_key="thread-1")
    named = {"X-RLProxy-Trajectory": "run-7", **session}
    assert key(turns[0], named, prompt_cache_key="thread-1") == key(turns[0], named)
    assert "thread-1" not in key(turns[0], prompt_cache_key="thread-1")
