"""The linking policy on its own: canonical messages, prefix hashes, and the decision rules."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from storage.linking import (
    DISCONNECT_GRACE_S,
    PrefixLinker,
    agent_signature,
    canonical_message,
    opening_hash,
    task_signature,
)
from storage.records import CallRecord, ChoiceRecord, LinkDecision, TrajectoryState


def _call(messages: list[dict[str, Any]], answer: str | None = "ok", **kw: Any) -> CallRecord:
    choices = [ChoiceRecord(0, {"role": "assistant", "content": answer})] if answer else []
    fields: dict[str, Any] = {
        "id": "c-new",
        "created_at": 1000.0,
        "finished_at": 1001.0,
        "model_requested": "policy",
        "engine": "local",
        "request_messages": messages,
        "choices": choices,
        "status": "completed" if answer else "error",
    }
    fields.update(kw)
    return CallRecord(**fields)


def _request_hash(messages: list[dict[str, Any]]) -> str:
    """The chained hash of `messages` as the linker computes it for an unkeyed call."""
    return PrefixLinker().keys(_call(messages)).request_hash


def _state(tid: str, **kw: Any) -> TrajectoryState:
    fields: dict[str, Any] = {
        "id": tid,
        "status": "open",
        "created_at": 900.0,
        "updated_at": 950.0,
        "turn_count": 1,
        "next_prefix_hash": None,
        "last_request_hash": None,
        "last_call_id": f"{tid}-last",
        "last_call_created_at": 940.0,
        "last_call_finished_at": 990.0,
    }
    fields.update(kw)
    return TrajectoryState(**fields)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (
            {"role": "user", "content": "  hello\n\n world "},
            {"content": "hello world", "role": "user"},
        ),
        (
            {
                "role": "user",
                "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "world"}],
            },
            {"role": "user", "content": "hello world"},
        ),
        ({"role": "developer", "content": "sys"}, {"role": "system", "content": "sys"}),
        (
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "x",
                        "type": "function",
                        "function": {"name": "f", "arguments": '{"a": 1, "b": [1, 2]}'},
                    }
                ],
                "refusal": None,
            },
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "function": {"arguments": '{\n  "b": [1,2],\n  "a": 1\n}', "name": "f"},
                        "type": "function",
                        "id": "y",
                    }
                ],
            },
        ),
        (
            {"role": "assistant", "content": "", "function_call": {"name": "f", "arguments": "{}"}},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"function": {"name": "f", "arguments": {}}}],
            },
        ),
    ],
)
def test_cosmetic_differences_canonicalise_equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert canonical_message(a) == canonical_message(b)
    assert _request_hash([a]) == _request_hash([b])


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ({"role": "user", "content": "hello"}, {"role": "user", "content": "Hello"}),
        ({"role": "user", "content": "x"}, {"role": "assistant", "content": "x"}),
        (
            {"role": "tool", "tool_call_id": "1", "content": "r"},
            {"role": "tool", "tool_call_id": "2", "content": "r"},
        ),
        (
            {
                "role": "assistant",
                "tool_calls": [{"function": {"name": "f", "arguments": '{"a":1}'}}],
            },
            {
                "role": "assistant",
                "tool_calls": [{"function": {"name": "f", "arguments": '{"a":2}'}}],
            },
        ),
        (
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "a.png"}}]},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "b.png"}}]},
        ),
    ],
)
def test_real_differences_hash_differently(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert _request_hash([a]) != _request_hash([b])


def test_prefix_hashes_chain_to_next_prefix_hash() -> None:
    linker = PrefixLinker()
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    first = linker.keys(_call(msgs, "a1"))
    history = [*msgs, {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}]
    second = linker.keys(_call(history, "a2"))
    assert second.prefix_hashes == {first.next_prefix_hash: 3}
    assert first.prefix_hashes == {}  # no assistant message yet
    # An error (no answer) has no continuation point.
    assert linker.keys(_call(msgs, None)).next_prefix_hash is None


def test_stored_hashes_are_computed_as_before() -> None:
    """The hashes a database holds (request, prefix and next-prefix hashes, keyed and unkeyed;
    the task and agent signatures) are pinned: a change to the canonical form or the chain
    would stop stored trajectories from linking and groups from forming, unless the store
    migrates."""
    msgs = [
        {"role": "system", "content": "Be  brief."},
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "f", "arguments": '{"b": 1, "a": 2}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "r"},
        {"role": "user", "content": "q2"},
    ]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    unkeyed = PrefixLinker().keys(_call(msgs, "done", tools=tools))
    assert unkeyed.prefix_hashes == {
        "7cfd3242bbc669c0751fe922cef29b805c8de565974bf6debea5e4c727ef5926": 3
    }
    assert unkeyed.request_hash == (
        "d3e8ae00d09ce06fcd6d1d78de6f0fc42d726612cf21eba8de36385e70f595af"
    )
    assert unkeyed.next_prefix_hash == (
        "10d83ed937c42e14f64a49bd0ab0f819323ac0c846b40faa8d826874f6ea26fc"
    )
    assert unkeyed.task_signature == (
        "42006facbfc4deb948e7e0f98c8e218d539dfb091e1870856e6e6bf764f14286"
    )
    keyed = PrefixLinker().keys(_call(msgs, "done", tools=tools, owner_key_id="k1"))
    assert keyed.request_hash == (
        "840b3eb765df76c32eead1d26135c8175ef0361cf6ddfd17e8b20f8865fc3c9a"
    )
    assert keyed.next_prefix_hash == (
        "2010b6dcc2145a77aa294a1d0c84a2c8115dd0b2a0050bab7da30b1ee0d45410"
    )
    assert agent_signature(msgs, tools) == (
        "f3caaaaba030f7bb382d359bf9cf861d204b4c9ff40563b48a2ddcd3a86fcb40"
    )


def test_the_opening_hash_is_the_first_answer_prefix_the_linker_continues_from() -> None:
    """`opening_hash` (the canary's conversation key) is the linker's own chain: the prefix
    hash through the first assistant message, which is the first turn's `next_prefix_hash`
    for an unkeyed call; every later turn repeats it."""
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    assert opening_hash(msgs) is None  # a first turn has no answer yet
    first = PrefixLinker().keys(_call(msgs, "a1"))
    turn2 = [*msgs, {"role": "assistant", "content": " a1 ", "refusal": None}]
    turn2 += [{"role": "user", "content": "q2"}]
    assert opening_hash(turn2) == first.next_prefix_hash
    turn3 = [*turn2, {"role": "assistant", "content": "a2"}, {"role": "user", "content": "q3"}]
    assert opening_hash(turn3) == opening_hash(turn2)
    second = PrefixLinker().keys(_call(turn3, "a3"))
    assert opening_hash(turn3) == min(second.prefix_hashes, key=second.prefix_hashes.__getitem__)
    keyed = PrefixLinker().keys(_call(msgs, "a1", owner_key_id="k1"))
    assert keyed.next_prefix_hash != first.next_prefix_hash  # keys chain apart; the opening not


def test_task_signature_covers_system_first_user_and_tools() -> None:
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]
    tools = [{"type": "function", "function": {"name": "f"}}]
    later = [*msgs, {"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"}]
    assert task_signature(msgs, tools) == task_signature(later, tools)
    assert task_signature(msgs, tools) != task_signature(msgs, None)
    assert task_signature(msgs, None) != task_signature(
        [msgs[0], {"role": "user", "content": "other"}], None
    )


def test_longest_prefix_then_most_recent() -> None:
    linker = PrefixLinker()
    m = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "q3"},
    ]
    record = _call(m)
    keys = linker.keys(record)
    h2, h4 = sorted(keys.prefix_hashes, key=keys.prefix_hashes.__getitem__)
    short = _state("short", next_prefix_hash=h2, updated_at=999.0)
    long_old = _state("long-old", next_prefix_hash=h4, updated_at=500.0)
    long_new = _state("long-new", next_prefix_hash=h4, updated_at=600.0)
    decision = linker.choose(record, keys, None, [short, long_old, long_new])
    assert (decision.action, decision.trajectory_id) == ("append", "long-new")
    assert linker.choose(record, keys, None, []).action == "new"


def _calls(*ids_names: tuple[str | None, str]) -> dict[str, Any]:
    """An assistant message calling each (id, name) with no arguments; id None: no id."""
    calls = [
        {"type": "function", "function": {"name": name, "arguments": "{}"}}
        | ({} if call_id is None else {"id": call_id})
        for call_id, name in ids_names
    ]
    return {"role": "assistant", "content": None, "tool_calls": calls}


def _answered(messages: list[dict[str, Any]], answer: dict[str, Any], **kw: Any) -> CallRecord:
    return replace(_call(messages, **kw), choices=[ChoiceRecord(0, answer)])


ASK = [{"role": "system", "content": "s"}, {"role": "user", "content": "read it"}]
ERROR = {"role": "tool", "tool_call_id": "call_0", "content": "invalid arguments"}


def test_a_tool_call_rewritten_under_the_same_ids_links_by_them() -> None:
    linker = PrefixLinker()
    stored = linker.keys(_answered(ASK, _calls(("call_0", "read"), ("call_1", "grep"))))
    assert stored.next_tool_call_hash is not None
    t = _state(
        "t",
        next_prefix_hash=stored.next_prefix_hash,
        next_tool_call_hash=stored.next_tool_call_hash,
    )

    # names, arguments and order rewritten; the ids and everything before them kept
    record = _call([*ASK, _calls(("call_1", "invalid"), ("call_0", "invalid")), ERROR])
    keys = linker.keys(record)
    assert keys.tool_call_hashes == {stored.next_tool_call_hash: 3}
    assert stored.next_prefix_hash not in keys.prefix_hashes  # the chain finds nothing
    assert linker.choose(record, keys, None, [t]) == LinkDecision("append", "t")

    def links(messages: list[dict[str, Any]], owner: str | None = None) -> bool:
        record = _call(messages, owner_key_id=owner)
        return linker.choose(record, linker.keys(record), None, [t]).action == "append"

    assert not links([*ASK, _calls(("call_0", "invalid")), ERROR])  # one id short
    assert not links([*ASK, _calls(("call_0", "a"), ("call_1", "b"), ("call_2", "c")), ERROR])
    assert not links([*ASK, _calls(("call_0", "a"), (None, "b")), ERROR])  # a call without id
    other = [ASK[0], {"role": "user", "content": "read another"}]
    assert not links([*other, _calls(("call_0", "a"), ("call_1", "b")), ERROR])  # other history
    assert not links([*ASK, _calls(("call_0", "a"), ("call_1", "b")), ERROR], owner="k2")
    # an answer without ids, or with no calls, leaves no tool-call key
    assert linker.keys(_answered(ASK, _calls((None, "read")))).next_tool_call_hash is None
    assert linker.keys(_call(ASK, "text")).next_tool_call_hash is None
    assert linker.keys(_call(ASK, None)).next_tool_call_hash is None  # no answer


def test_the_longest_match_wins_and_the_chain_wins_ties() -> None:
    linker = PrefixLinker()
    first = _calls(("call_0", "read"))
    opening = linker.keys(_answered(ASK, first))
    # `chained` stopped after the first answer; `rewritten` went on to a second call, which
    # the request resends rewritten under its id.
    turn2 = [*ASK, first, ERROR]
    second = linker.keys(_answered(turn2, _calls(("call_9", "read"))))
    chained = _state("chained", next_prefix_hash=opening.next_prefix_hash, updated_at=999.0)
    rewritten = _state(
        "rewritten",
        next_prefix_hash=second.next_prefix_hash,
        next_tool_call_hash=second.next_tool_call_hash,
        updated_at=500.0,
    )
    record = _call([*turn2, _calls(("call_9", "invalid")), {**ERROR, "tool_call_id": "call_9"}])
    keys = linker.keys(record)
    assert keys.prefix_hashes[opening.next_prefix_hash or ""] == 3
    assert keys.tool_call_hashes[second.next_tool_call_hash or ""] == 5
    assert linker.choose(record, keys, None, [chained, rewritten]).trajectory_id == "rewritten"

    # At equal length the chain wins, even over a newer trajectory with the same ids.
    echoed = _state("echoed", next_prefix_hash=opening.next_prefix_hash, updated_at=100.0)
    same_ids = _state(
        "same-ids",
        next_prefix_hash="another answer",
        next_tool_call_hash=opening.next_tool_call_hash,
        updated_at=999.0,
    )
    record = _call(turn2)
    keys = linker.keys(record)
    assert linker.choose(record, keys, None, [same_ids, echoed]).trajectory_id == "echoed"
    assert linker.choose(record, keys, None, [same_ids]).trajectory_id == "same-ids"


def test_the_tool_call_hash_is_computed_as_before() -> None:
    """Stored in `trajectories.next_tool_call_hash`: pinned, like the chain's hashes."""
    keys = PrefixLinker().keys(_answered(ASK, _calls(("call_b", "f"), ("call_a", "g"))))
    assert keys.next_tool_call_hash == (
        "32ff531641f904323e878346ea77a5de5ed0b4ebfc2aee12aea8562d2e734296"
    )
    keyed = PrefixLinker().keys(
        _answered(ASK, _calls(("call_b", "f"), ("call_a", "g")), owner_key_id="k1")
    )
    assert keyed.next_tool_call_hash == (
        "ab0a4963e81c87979e5935ed338143afa8e5313ea7d691324bebd52c99e8c3f0"
    )


def test_retry_rules() -> None:
    linker = PrefixLinker(retry_window_s=10.0)
    msgs = [{"role": "user", "content": "q"}]
    record = _call(msgs, created_at=1000.0)
    keys = linker.keys(record)
    last = _state("t", last_request_hash=keys.request_hash, last_call_finished_at=995.0)

    d = linker.choose(record, keys, None, [last])
    assert (d.action, d.trajectory_id, d.same_turn_as) == ("retry", "t", "t-last")
    # Outside the window: a new run of the same task, unless the client says it is a retry.
    stale = replace(last, last_call_finished_at=900.0)
    assert linker.choose(record, keys, None, [stale]).action == "new"
    assert linker.choose(replace(record, retry_count=2), keys, None, [stale]).action == "retry"
    # Started before the last call finished: overlapping calls are parallel runs.
    overlapping = replace(last, last_call_finished_at=1000.5)
    assert linker.choose(record, keys, None, [overlapping]).action == "new"
    # The last call completed: the same request again is a new sample, not a retry.
    answered = replace(last, last_call_status="completed")
    assert linker.choose(record, keys, None, [answered]).action == "new"
    assert linker.choose(replace(record, retry_count=1), keys, None, [answered]).action == "retry"
    # Window 0 turns the time rule off.
    assert PrefixLinker(retry_window_s=0).choose(record, keys, None, [last]).action == "new"
    # A failed attempt that started before the standing call is a late-recorded attempt.
    late = replace(record, status="client_disconnected", created_at=930.0)
    assert linker.choose(late, keys, None, [last]).action == "stale"
    assert linker.choose(replace(late, status="completed"), keys, None, [last]).action == "new"


def test_a_resend_racing_the_noticed_disconnect_is_a_retry() -> None:
    """A client that times out closes its connection and resends at once; the server notices
    the disconnect (and stamps the attempt finished) only a moment later, so the resend can
    start before the attempt it repeats "finished". That is still a retry, not a new turn."""
    linker = PrefixLinker(retry_window_s=10.0)
    record = _call([{"role": "user", "content": "q"}], created_at=1000.0)
    keys = linker.keys(record)
    gone = _state(
        "t",
        last_request_hash=keys.request_hash,
        last_call_created_at=999.0,
        last_call_finished_at=1000.4,
        last_call_status="client_disconnected",
    )
    d = linker.choose(record, keys, None, [gone])
    assert (d.action, d.trajectory_id, d.same_turn_as) == ("retry", "t", "t-last")
    # Beyond the grace it is an overlapping parallel run again, as for a failed attempt.
    late_notice = replace(gone, last_call_finished_at=1000.0 + DISCONNECT_GRACE_S + 0.5)
    assert linker.choose(record, keys, None, [late_notice]).action == "new"
    errored = replace(gone, last_call_status="error")
    assert linker.choose(record, keys, None, [errored]).action == "new"


def test_explicit_id() -> None:
    linker = PrefixLinker()
    record = _call([{"role": "user", "content": "q"}], explicit_trajectory_id="run-1")
    keys = linker.keys(record)
    other = _state("other", next_prefix_hash="x", last_request_hash=keys.request_hash)
    d = linker.choose(record, keys, None, [other])
    assert (d.action, d.trajectory_id) == ("new", "run-1")
    closed = _state("run-1", status="closed")
    d = linker.choose(record, keys, closed, [other])
    assert (d.action, d.trajectory_id) == ("append", "run-1")


def test_negative_window_is_refused() -> None:
    with pytest.raises(ValueError, match="retry_window_s"):
        PrefixLinker(retry_window_s=-1)


def test_the_agent_signature_ignores_what_changes_between_sessions_of_one_agent() -> None:
    """Coding agents write the date, the working directory, their version and git ids into
    their system prompt; the agent keeps one signature. Tool descriptions and schemas may list
    a task's own values: only tool names count."""

    def system(date: str, cwd: str, version: str, commit: str) -> list[dict[str, Any]]:
        text = (
            f"You are a coding agent v{version}.\nToday's date is {date}.\n"
            f"Working directory: {cwd}\nLast commit {commit}. Be brief."
        )
        return [{"role": "system", "content": text}, {"role": "user", "content": "fix it"}]

    def tool(name: str, choices: list[str]) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": name,
                "description": f"Look up one of {', '.join(choices)}",
                "parameters": {"type": "object", "properties": {"w": {"enum": choices}}},
            },
        }

    a = agent_signature(
        system("2026-12-05", "/home/ana/proj", "2.1.332", "3f9c2e1a"),
        [tool("find", ["lime", "pink"]), tool("get", ["lime", "pink"])],
    )
    b = agent_signature(
        system("2027-01-31", "/srv/work/other-repo", "2.1.400", "a1b2c3d4e5"),
        [tool("get", ["oak"]), tool("find", ["oak"])],
    )
    assert a == b
    other_prompt = [{"role": "system", "content": "You are a different agent."}]
    assert agent_signature(other_prompt, [tool("find", []), tool("get", [])]) != a
    assert agent_signature(system("2026-12-05", "/x/y", "1", "0"), [tool("find", [])]) != a
    responses_tool = {"type": "function", "name": "find", "parameters": {}}
    assert agent_signature([], [responses_tool]) == agent_signature([], [tool("find", ["z"])])


def test_the_agent_signature_is_the_system_prompt_before_the_conversation() -> None:
    """Claude Code's system prompt opens with a billing line whose version suffix changes from
    call to call (`cc_version=2.1.332.822`, then `.fcf`, `.cf6`), and it puts system messages
    inside the conversation (its environment; after a compaction, a note on deferred tools).
    Neither is the agent: its signature is the system messages before the first other message,
    volatile parts masked, so a compacted session keeps its agent (measured with Claude Code
    2.1.332: the continuation after /compact had another suffix and another inner message)."""

    def call(suffix: str, inner: str) -> list[dict[str, Any]]:
        head = f"x-anthropic-billing-header: cc_version=2.1.332.{suffix}; cc_entrypoint=sdk-cli;"
        return [
            {"role": "system", "content": head + " You are a Claude agent."},
            {"role": "user", "content": "fix it"},
            {"role": "system", "content": inner},
        ]

    tools = [{"type": "function", "function": {"name": "Read", "parameters": {}}}]
    first = agent_signature(call("822", "# Environment\nPrimary working directory: /w"), tools)
    later = agent_signature(call("cf6", "The following deferred tools are now available"), tools)
    assert first == later
    assert (
        agent_signature([*call("822", "x")[:1], {"role": "user", "content": "y"}], tools) == first
    )
    other = [{"role": "system", "content": "You are a Claude agent. Another."}]
    assert agent_signature(other, tools) != first


# --- session lanes: a coding agent's session, and which agent of it -------------------------
# Claude Code compacts its history: a summarisation call, then a REWRITTEN history (the summary,
# re-read files, the new message) that neither the chain nor the tool-call ids find. The call's
# session lane (`CallRecord.session_lane`, from the agent's session headers) and its agent
# signature find the trajectory instead, and the turn is marked as a rewritten history.

AGENT_SYSTEM = "You are Claude Code. Today's date is 2026-12-05. Working directory: /home/ana/x"
AGENT_TOOLS = [{"type": "function", "function": {"name": n}} for n in ("Read", "Bash", "Task")]
MAIN = [{"role": "system", "content": AGENT_SYSTEM}, {"role": "user", "content": "fix the test"}]
REWRITTEN = [
    {"role": "system", "content": AGENT_SYSTEM},
    {"role": "user", "content": "This session is being continued. Summary: fixed half of it."},
    {"role": "user", "content": "<system-reminder>contents of test_x.py</system-reminder>"},
    {"role": "user", "content": "go on"},
]


def _in_lane(messages: list[dict[str, Any]], lane: str | None = "s1", **kw: Any) -> CallRecord:
    return _call(messages, tools=AGENT_TOOLS, session_lane=lane, **kw)


def _lane_state(tid: str, record: CallRecord, **kw: Any) -> TrajectoryState:
    """A trajectory whose last call was `record` (its lane and agent signature)."""
    keys = PrefixLinker().keys(record)
    fields: dict[str, Any] = {
        "next_prefix_hash": keys.next_prefix_hash,
        "last_request_hash": keys.request_hash,
        "session_lane": keys.session_lane,
        "agent_signature": keys.agent_signature,
    }
    return _state(tid, **(fields | kw))


def test_a_rewritten_history_in_the_same_lane_continues_with_a_boundary() -> None:
    linker = PrefixLinker()
    main = _lane_state("main", _in_lane(MAIN))
    record = _in_lane(REWRITTEN)
    keys = linker.keys(record)
    assert keys.session_lane is not None and keys.agent_signature is not None
    assert linker.choose(record, keys, None, [main]) == LinkDecision(
        "append", "main", history_rewritten=True
    )
    # The most recently updated trajectory of the lane and agent takes it.
    newer = _lane_state("newer", _in_lane(MAIN), updated_at=980.0)
    assert linker.choose(record, keys, None, [main, newer]).trajectory_id == "newer"
    # Another lane, another agent or a closed trajectory: a new one.
    other = _in_lane(REWRITTEN, lane="s2")
    assert linker.choose(other, linker.keys(other), None, [main]).action == "new"
    closed = replace(main, status="closed")
    assert linker.choose(record, keys, None, [closed]).action == "new"


def test_without_a_lane_nothing_changes() -> None:
    linker = PrefixLinker()
    main = _lane_state("main", _in_lane(MAIN))
    record = _in_lane(REWRITTEN, lane=None)
    keys = linker.keys(record)
    assert (keys.session_lane, keys.parent_lane, keys.agent_signature) == (None, None, None)
    assert linker.choose(record, keys, None, [main], [main]) == LinkDecision("new")


def test_the_chain_and_the_ids_win_over_the_lane() -> None:
    linker = PrefixLinker()
    first = _in_lane(MAIN, answer="a1")
    chained = _lane_state("chained", first, updated_at=900.0)
    newest = _lane_state("newest", _in_lane(MAIN, answer="other answer"), updated_at=999.0)
    turn2 = [*MAIN, {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q"}]
    record = _in_lane(turn2)
    keys = linker.keys(record)
    assert linker.choose(record, keys, None, [newest, chained]) == LinkDecision("append", "chained")


def test_a_sub_agent_is_its_own_trajectory_with_its_parent() -> None:
    """Claude Code's sub-agent: the session's header and its own agent id, so its own lane; its
    parent lane is the main agent's (the session without an agent id)."""
    linker = PrefixLinker()
    main = _lane_state("main", _in_lane(MAIN), updated_at=990.0)
    side = _lane_state("side", _in_lane(MAIN, lane="s1/agent-b"), updated_at=995.0)
    task = [{"role": "system", "content": "You are a search agent."}, MAIN[1]]
    record = _in_lane(task, lane="s1/agent-a", parent_lane="s1")
    keys = linker.keys(record)
    assert keys.parent_lane == linker.keys(_in_lane(MAIN)).session_lane
    decision = linker.choose(record, keys, None, [], [main, side])
    assert decision == LinkDecision("new", parent_trajectory_id="main")
    # No trajectory in the parent lane (yet): no parent.
    assert linker.choose(record, keys, None, [], [side]) == LinkDecision("new")


def test_another_agent_in_the_same_lane_is_its_own_trajectory_with_a_parent() -> None:
    """OpenCode's title call: same session header, another system prompt and no tools."""
    linker = PrefixLinker()
    main = _lane_state("main", _in_lane(MAIN))
    title = [{"role": "system", "content": "Write a title."}, MAIN[1]]
    record = _call(title, session_lane="s1")
    keys = linker.keys(record)
    assert keys.agent_signature != main.agent_signature
    assert linker.choose(record, keys, None, [], [main]) == LinkDecision(
        "new", parent_trajectory_id="main"
    )
    # A call with tools is not a side call: OpenCode's title ends (and is linked) before the
    # first answer of the main agent, which must not become the title's child.
    first_answer = _in_lane(MAIN)
    title_first = _lane_state("title", record)
    decision = linker.choose(first_answer, linker.keys(first_answer), None, [], [title_first])
    assert decision == LinkDecision("new")
    # The same agent again after its trajectory closed: a new episode, no parent.
    closed = replace(main, status="closed")
    again = _in_lane(REWRITTEN)
    assert linker.choose(again, linker.keys(again), None, [], [closed]) == LinkDecision("new")


def test_lanes_are_hashed_per_api_key() -> None:
    linker = PrefixLinker()
    mine = linker.keys(_in_lane(MAIN, owner_key_id="k1"))
    theirs = linker.keys(_in_lane(MAIN, owner_key_id="k2"))
    unkeyed = linker.keys(_in_lane(MAIN))
    assert len({mine.session_lane, theirs.session_lane, unkeyed.session_lane}) == 3
    assert "s1" not in (mine.session_lane or "")
    main = _lane_state("main", _in_lane(MAIN, owner_key_id="k1"))
    record = _in_lane(REWRITTEN, owner_key_id="k2")
    decision = linker.choose(record, linker.keys(record), None, [main], [main])
    assert decision == LinkDecision("new")


def test_the_lane_hash_is_computed_as_before() -> None:
    """Stored in `trajectories.session_lane`: pinned, like the chain's hashes."""
    keys = PrefixLinker().keys(_in_lane(MAIN, lane="s1/agent-a", parent_lane="s1"))
    assert (keys.session_lane, keys.parent_lane) == (
        "a944129527c498a08679817c456c8ed5aa0071f9aaba1a2e6f40130284451ca7",
        "a56869403de1fd4d6f6ebf78ddf9b8874d915565e4c1cc7366f8e3484cd09406",
    )
    keyed = PrefixLinker().keys(_in_lane(MAIN, lane="s1/agent-a", owner_key_id="k1"))
    assert keyed.session_lane == (
        "6dc062f11f78490dca8624b9e0717fd51fa177974c5b17d13427503c421604bb"
    )
