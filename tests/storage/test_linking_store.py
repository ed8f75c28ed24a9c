"""Trajectory linking end to end: the store with `storage.linking.PrefixLinker`, both backends.

The canonicalisation and decision rules themselves are unit-tested in
tests/storage/test_linking.py; here every call goes through `Store.record_call`.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from sqlalchemy import text

from storage import Store, migrations
from storage.engines import create_engines
from storage.linking import PrefixLinker
from tests.storage.conftest import Database

pytestmark = pytest.mark.asyncio(loop_scope="session")

SYSTEM = "You are an agent. Use the tools."


def _tool_call(call_id: str, name: str, args: dict[str, Any], **dump: Any) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(args, **dump)},
            }
        ],
    }


async def test_three_tool_rounds_make_one_trajectory(store: Store, make_call: Any) -> None:
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is the weather in Paris and Rome?"},
    ]
    answers = [
        _tool_call("call_a", "weather", {"city": "Paris", "unit": "C"}),
        _tool_call("call_b", "weather", {"city": "Rome", "unit": "C"}),
        _tool_call("call_c", "summarise", {"items": [1, 2]}),
        {"role": "assistant", "content": "Paris 12C, Rome 18C."},
    ]
    tids = []
    for round_, answer in enumerate(answers):
        tids.append(await store.record_call(make_call(msgs, answer)))
        # The client echoes the answer back with cosmetic changes: key order, whitespace,
        # re-serialised arguments, content "" instead of None, extra fields dropped.
        fn = answer.get("tool_calls", [{}])[0].get("function")
        echoed: dict[str, Any]
        if fn:
            args = json.loads(fn["arguments"])
            echoed = {
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {
                            "arguments": json.dumps(dict(reversed(args.items())), indent=2),
                            "name": fn["name"],
                        },
                        "id": answer["tool_calls"][0]["id"],
                    }
                ],
                "content": "",
                "role": "assistant",
            }
            tool_reply = {
                "role": "tool",
                "tool_call_id": answer["tool_calls"][0]["id"],
                "content": f"result {round_}",
            }
            msgs = [*msgs, echoed, tool_reply]
        msgs = [
            {**m, "content": f"  {m['content']}\n"} if isinstance(m.get("content"), str) else m
            for m in msgs
        ]
    assert len(set(tids)) == 1
    detail = await store.get_trajectory(tids[0])
    assert detail is not None
    assert detail.summary.turn_count == 4
    assert [t.turn_index for t in detail.turns] == [0, 1, 2, 3]


async def test_two_agents_same_system_prompt_make_two(store: Store, make_call: Any) -> None:
    async def agent(question: str) -> set[str]:
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        tids = set()
        for i in range(3):
            answer = _tool_call(f"call_{i}", "search", {"q": question, "i": i})
            tids.add(await store.record_call(make_call(msgs, answer)))
            tool = {"role": "tool", "tool_call_id": f"call_{i}", "content": "found"}
            msgs = [*msgs, answer, tool]
            await asyncio.sleep(0)
        return tids

    a, b = await asyncio.gather(agent("capital of France?"), agent("capital of Italy?"))
    assert len(a) == 1 and len(b) == 1 and a != b
    for tid in a | b:
        detail = await store.get_trajectory(tid)
        assert detail is not None and detail.summary.turn_count == 3
    (ta,), (tb,) = a, b
    da, db_ = await store.get_trajectory(ta), await store.get_trajectory(tb)
    assert da is not None and db_ is not None
    assert da.summary.task_signature != db_.summary.task_signature


async def test_same_task_twice_concurrently_makes_two(store: Store, make_call: Any) -> None:
    """Parallel rollouts of one task overlap in time: identical first calls are not retries."""
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "same task"}]
    first = make_call(msgs, "plan A", created_at=1000.0, duration_s=2.0)
    second = make_call(msgs, "plan B", created_at=1000.5, duration_s=1.0)
    t2 = await store.record_call(second)  # finishes first
    t1 = await store.record_call(first)
    assert t1 != t2
    d1, d2 = await store.get_trajectory(t1), await store.get_trajectory(t2)
    assert d1 is not None and d2 is not None
    assert d1.summary.task_signature == d2.summary.task_signature
    # Each continues on its own answer.
    c1 = make_call([*msgs, {"role": "assistant", "content": "plan A"}], "A2", created_at=1003.0)
    c2 = make_call([*msgs, {"role": "assistant", "content": "plan B"}], "B2", created_at=1003.0)
    assert await store.record_call(c1) == t1
    assert await store.record_call(c2) == t2


async def test_explicit_id_wins(store: Store, make_call: Any) -> None:
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "q"}]
    tid = await store.record_call(make_call(msgs, "a1", explicit_trajectory_id="run-42"))
    assert tid == "run-42"
    # Unrelated messages, same explicit id: appended anyway.
    other = [{"role": "user", "content": "something else entirely"}]
    assert await store.record_call(make_call(other, "a2", explicit_trajectory_id="run-42")) == tid
    # A continuation of run-42 that names a different id goes there instead.
    cont = [*other, {"role": "assistant", "content": "a2"}, {"role": "user", "content": "more"}]
    assert await store.record_call(make_call(cont, "a3", explicit_trajectory_id="run-43")) == (
        "run-43"
    )
    detail = await store.get_trajectory("run-42")
    assert detail is not None and detail.summary.turn_count == 2 and detail.summary.explicit


async def test_explicit_id_reopens_closed(store: Store, make_call: Any) -> None:
    msgs = [{"role": "user", "content": "q"}]
    tid = await store.record_call(make_call(msgs, "a", explicit_trajectory_id="ep-1"))
    await store.end_trajectory(tid)
    again = [*msgs, {"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"}]
    assert await store.record_call(make_call(again, "b", explicit_trajectory_id="ep-1")) == tid
    detail = await store.get_trajectory(tid)
    assert detail is not None
    assert detail.summary.status == "open" and detail.summary.closed_at is None
    assert detail.summary.turn_count == 2


async def test_retry_header_does_not_fork(store: Store, make_call: Any) -> None:
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "q"}]
    first = make_call(msgs, "a", created_at=1000.0)
    tid = await store.record_call(first)
    cont = [*msgs, {"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"}]
    failed = make_call(cont, None, created_at=1001.0)
    assert await store.record_call(failed) == tid
    retried = make_call(cont, "b", created_at=1100.0, retry_count=1)  # long after: header counts
    assert await store.record_call(retried) == tid

    detail = await store.get_trajectory(tid)
    assert detail is not None
    assert detail.summary.turn_count == 2 and detail.summary.call_count == 3
    assert [t.call_id for t in detail.turns] == [first.id, retried.id]
    assert detail.turns[1].retry_of == failed.id and detail.turns[1].attempts == 2
    old = await store.get_call(failed.id)
    assert old is not None and old.superseded_by == retried.id and old.turn_index == 1
    # The conversation continues from the retry's answer.
    nxt = [*cont, {"role": "assistant", "content": "b"}, {"role": "user", "content": "q3"}]
    assert await store.record_call(make_call(nxt, "c", created_at=1101.0)) == tid


async def test_same_messages_within_window_is_a_retry(store: Store, make_call: Any) -> None:
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "q"}]
    first = make_call(msgs, None, created_at=1000.0, duration_s=1.0, status="error")
    tid = await store.record_call(first)
    again = make_call(msgs, "a'", created_at=1003.0)  # 2 s after it failed, no header
    assert await store.record_call(again) == tid
    detail = await store.get_trajectory(tid)
    assert detail is not None and detail.summary.turn_count == 1
    assert detail.turns[0].call_id == again.id and detail.turns[0].attempts == 2
    # `again` completed: the same request right after it is a new sample of the task.
    sample = make_call(msgs, "b", created_at=1004.0)
    assert await store.record_call(sample) != tid
    later = make_call(msgs, None, created_at=1100.0, status="error")
    assert await store.record_call(later) not in (tid, None)


async def test_late_recorded_failed_attempt_goes_to_same_turn(store: Store, make_call: Any) -> None:
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "slow"}]
    original = make_call(
        msgs, None, created_at=1000.0, duration_s=30.0, status="client_disconnected"
    )
    retry = make_call(msgs, "fast", created_at=1010.0, retry_count=1)
    tid = await store.record_call(retry)  # the retry finishes first
    assert await store.record_call(original) == tid
    detail = await store.get_trajectory(tid)
    assert detail is not None
    assert detail.summary.turn_count == 1 and detail.turns[0].call_id == retry.id
    stored = await store.get_call(original.id)
    assert stored is not None and stored.superseded_by == retry.id
    nxt = [*msgs, {"role": "assistant", "content": "fast"}, {"role": "user", "content": "go"}]
    assert await store.record_call(make_call(nxt, "ok", created_at=1020.0)) == tid


async def test_closed_trajectory_is_not_continued(store: Store, make_call: Any) -> None:
    msgs = [{"role": "user", "content": "q"}]
    tid = await store.record_call(make_call(msgs, "a"))
    await store.add_reward(tid, 1.0, "env")
    cont = [*msgs, {"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"}]
    new = await store.record_call(make_call(cont, "b"))
    assert new != tid
    detail = await store.get_trajectory(new)
    assert detail is not None and detail.summary.status == "open"


async def test_longest_prefix_wins(store: Store, make_call: Any) -> None:
    base = [{"role": "user", "content": "q"}]
    short = await store.record_call(make_call(base, "a"))
    two = [*base, {"role": "assistant", "content": "a"}, {"role": "user", "content": "q2"}]
    # A second trajectory that got explicitly to the longer prefix.
    long_ = await store.record_call(make_call(two, "b", explicit_trajectory_id="long"))
    assert long_ == "long"
    # `short` still points at [q, a]; `long` at [q, a, q2, b]. This call contains both.
    three = [*two, {"role": "assistant", "content": "b"}, {"role": "user", "content": "q3"}]
    assert await store.record_call(make_call(three, "c")) == "long"
    assert short != long_


# --- tool-call ids: a turn whose tool call the client rewrote -------------------------------
# OpenCode answers a tool call cut by max_tokens (arguments `{"file`) by resending it under the
# same id as a call of its `invalid` tool, then the tool's error. The chain (names, arguments)
# no longer matches; the ids, after the same request, do.


def _cut_call(call_id: str) -> dict[str, Any]:
    call = {"id": call_id, "type": "function", "function": {"name": "read", "arguments": '{"file'}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def _rewritten(call_id: str) -> list[dict[str, Any]]:
    """The cut call resent as OpenCode does, and the tool's error."""
    return [
        _tool_call(call_id, "invalid", {"tool": "read", "error": "Invalid input"}),
        {"role": "tool", "tool_call_id": call_id, "content": "The arguments are invalid."},
    ]


async def test_a_rewritten_tool_call_continues_by_its_id(store: Store, make_call: Any) -> None:
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Show README.md"}]
    tid = await store.record_call(make_call(msgs, _cut_call("call_Xy12")))
    second = [*msgs, *_rewritten("call_Xy12")]
    assert await store.record_call(make_call(second, "Let me retry.")) == tid
    # The next turn resends the rewritten history: the ordinary chain again.
    third = [*second, {"role": "assistant", "content": "Let me retry."}]
    third += [{"role": "user", "content": "go on"}]
    assert await store.record_call(make_call(third, "ok")) == tid
    detail = await store.get_trajectory(tid)
    assert detail is not None and detail.summary.turn_count == 3


async def test_the_same_ids_after_other_messages_do_not_link(store: Store, make_call: Any) -> None:
    """Providers that number calls (`call_0`) give every conversation the same ids."""
    task_a = [{"role": "user", "content": "Fix the failing test"}]
    task_b = [{"role": "user", "content": "Add a --verbose flag"}]
    ta = await store.record_call(make_call(task_a, _cut_call("call_0")))
    tb = await store.record_call(make_call(task_b, _cut_call("call_0")))
    assert ta != tb
    task_c = [{"role": "user", "content": "Rename utils.py"}]
    tc = await store.record_call(make_call([*task_c, *_rewritten("call_0")], "done"))
    assert tc not in (ta, tb)
    assert await store.record_call(make_call([*task_b, *_rewritten("call_0")], "done")) == tb
    detail = await store.get_trajectory(ta)
    assert detail is not None and detail.summary.turn_count == 1


async def test_tool_call_ids_never_link_across_api_keys(store: Store, make_call: Any) -> None:
    msgs = [{"role": "user", "content": "Show README.md"}]
    mine = await store.record_call(make_call(msgs, _cut_call("call_0"), owner_key_id="k1"))
    rewritten = [*msgs, *_rewritten("call_0")]
    theirs = await store.record_call(make_call(rewritten, "done", owner_key_id="k2"))
    assert theirs != mine
    assert await store.record_call(make_call(rewritten, "done", owner_key_id="k1")) == mine


async def test_the_chain_wins_over_tool_call_ids(store: Store, make_call: Any) -> None:
    """Two runs of one request answered with the same id but other calls: the newer has the
    same ids at the same place, but the history that echoes the older's answer goes there."""
    msgs = [{"role": "user", "content": "Search the docs"}]
    older = await store.record_call(make_call(msgs, _tool_call("call_0", "search", {"q": "x"})))
    newer = await store.record_call(make_call(msgs, _tool_call("call_0", "lookup", {"k": "y"})))
    assert older != newer
    echoed = [*msgs, _tool_call("call_0", "search", {"q": "x"})]
    echoed += [{"role": "tool", "tool_call_id": "call_0", "content": "found"}]
    assert await store.record_call(make_call(echoed, "done")) == older
    # A rewrite of the same call matches both by ids: the newest run takes it, as for the chain.
    assert await store.record_call(make_call([*msgs, *_rewritten("call_0")], "done")) == newer


async def test_ids_link_only_to_the_last_answer(store: Store, make_call: Any) -> None:
    """The ids are the trajectory's continuation point, like the chain's hash: once a later
    answer was given, a rewrite of an earlier call is another branch, not this trajectory."""
    msgs = [{"role": "user", "content": "Show README.md"}]
    tid = await store.record_call(make_call(msgs, _cut_call("call_0")))
    second = [*msgs, *_rewritten("call_0")]
    assert await store.record_call(make_call(second, "Sorry.")) == tid
    again = [*msgs, *_rewritten("call_0")[:1]]
    again += [{"role": "tool", "tool_call_id": "call_0", "content": "another error"}]
    assert await store.record_call(make_call(again, "Hm.")) != tid


async def _stored_before(
    db: Database, monkeypatch: pytest.MonkeyPatch, kept: int, first: Any
) -> list[str]:
    """Migrate to the first `kept` migrations, store `first`'s trajectory (id "t-old") as a
    store of then wrote it (the columns every version has), then migrate the rest; return the
    migrations that ran last."""
    keys = PrefixLinker().keys(first)
    engines = create_engines(db.url, postgres_schema=db.schema)
    try:
        with monkeypatch.context() as m:
            m.setattr(migrations, "MIGRATIONS", migrations.MIGRATIONS[:kept])
            await migrations.migrate(engines.write)
        async with engines.write.begin() as conn:
            row = {
                "id": "t-old",
                "status": "open",
                "created_at": first.created_at,
                "updated_at": first.finished_at,
                "turn_count": 1,
                "call_count": 1,
                "explicit": False,
                "next_prefix_hash": keys.next_prefix_hash,
                "last_request_hash": keys.request_hash,
                "last_call_id": first.id,
                "last_call_created_at": first.created_at,
                "last_call_finished_at": first.finished_at,
                "last_call_status": "completed",
            }
            columns = ", ".join(row)
            values = ", ".join(f":{c}" for c in row)
            await conn.execute(text(f"INSERT INTO trajectories ({columns}) VALUES ({values})"), row)
        return await migrations.migrate(engines.write)
    finally:
        await engines.dispose()


async def test_a_trajectory_from_before_the_id_key_gets_it_at_its_next_answer(
    db: Database, make_call: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Trajectories stored before m011 have no tool-call key: they link by the chain as before,
    and their next answer sets the key (linking reads only the trajectories table)."""
    msgs = [{"role": "user", "content": "Show README.md"}]
    first = make_call(msgs, _tool_call("call_0", "read", {"file": "README.md"}))
    applied = await _stored_before(db, monkeypatch, 10, first)
    assert applied == [m.name for m in migrations.MIGRATIONS[10:]]  # m011 and after

    store = await db.open()
    rewritten = [*msgs, *_rewritten("call_0")]
    assert await store.record_call(make_call(rewritten, "Sorry.")) != "t-old"  # no key yet
    echoed = [*msgs, first.choices[0].message]
    echoed += [{"role": "tool", "tool_call_id": "call_0", "content": "# rlproxy"}]
    assert await store.record_call(make_call(echoed, _cut_call("call_1"))) == "t-old"
    assert await store.record_call(make_call([*echoed, *_rewritten("call_1")], "ok")) == "t-old"


# --- the cost of linking does not grow with history ---------------------------------------
# Linking reads trajectory rows; how many it reads per call must stay under a small constant
# however many runs of one task are stored (`Store.link_stats` counts them). The history below
# is many runs of one task: the same first messages, answered the same way (temperature 0) or
# not, some going on to a second turn, some failing and being retried.

TASK = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 17 * 23?"}]


async def _rows_per_call(store: Store, record: Any) -> tuple[str, int]:
    before = store.link_stats.rows
    tid = await store.record_call(record)
    return tid, store.link_stats.rows - before


@pytest.mark.parametrize("history", [20, 200])
async def test_linking_reads_a_bounded_number_of_rows_per_call(
    store: Store, make_call: Any, history: int
) -> None:
    second_turn = [
        *TASK,
        {"role": "assistant", "content": "391"},
        {"role": "user", "content": "Why?"},
    ]
    for i in range(history):
        await store.record_call(make_call(TASK, "391"))  # a run of the task, answered
        if i % 4 == 0:
            await store.record_call(make_call(second_turn, "17 * 23 = 391."))  # it goes on

    # The task again: a new run; nothing it could join is read beyond the newest few.
    tid, rows = await _rows_per_call(store, make_call(TASK, "391"))
    assert rows <= 2, f"read {rows} trajectory rows after {history} runs"
    # Its second turn joins it (the newest run with that prefix), reading one row for the prefix.
    tid2, rows = await _rows_per_call(store, make_call(second_turn, "Because."))
    assert tid2 == tid
    assert rows <= 2, f"read {rows} trajectory rows after {history} runs"
    # A failed call of the task, then its retry: the retry finds the failed run.
    failed = make_call(TASK, None)
    failed_tid, rows = await _rows_per_call(store, failed)
    assert rows <= 2
    retry = make_call(TASK, "391", created_at=failed.finished_at + 0.5)
    retry_tid, rows = await _rows_per_call(store, retry)
    assert retry_tid == failed_tid
    assert rows <= 2, f"read {rows} trajectory rows after {history} runs"
    # A client-marked retry of the last call (x-stainless-retry-count) joins the newest run.
    again = make_call(TASK, "391", retry_count=1, created_at=retry.finished_at + 0.1)
    again_tid, rows = await _rows_per_call(store, again)
    assert again_tid == retry_tid
    assert rows <= 4, f"read {rows} trajectory rows after {history} runs"


@pytest.mark.parametrize("history", [20, 200])
async def test_linking_by_tool_call_ids_reads_a_bounded_number_of_rows(
    store: Store, make_call: Any, history: int
) -> None:
    """Every run of the task answered with the same id (`call_0`) after the same request: all
    share one tool-call hash, and a rewrite still reads only the newest."""
    for _ in range(history):
        await store.record_call(make_call(TASK, _cut_call("call_0")))
    tid, rows = await _rows_per_call(store, make_call(TASK, _cut_call("call_0")))
    assert rows <= 2, f"read {rows} trajectory rows after {history} runs"
    rewritten = make_call([*TASK, *_rewritten("call_0")], "Let me retry.")
    tid2, rows = await _rows_per_call(store, rewritten)
    assert tid2 == tid
    assert rows <= 2, f"read {rows} trajectory rows after {history} runs"


# --- session lanes: compaction, sub-agents, side calls -----------------------------------
# A coding agent's calls carry its session (`CallRecord.session_lane`, from its headers); a
# sub-agent's, its own agent id too (`parent_lane`: the main agent's lane). See storage.linking.

CLAUDE = "You are Claude Code. Today's date is 2026-12-05. Working directory: /home/ana/proj"
CLAUDE_TOOLS = [
    {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
    for n in ("Read", "Bash", "Task")
]
SUMMARISE = "CRITICAL: Respond with TEXT ONLY. Summarise the conversation so far."


def _session(**lane: Any) -> Any:
    """make_call for one agent of a session: its tools and its lane."""

    def call(make_call: Any, messages: list[dict[str, Any]], answer: Any = "ok", **kw: Any) -> Any:
        return make_call(messages, answer, tools=CLAUDE_TOOLS, **(lane | kw))

    return call


MAIN_LANE = _session(session_lane="sess-1")


async def _two_turns(store: Store, make_call: Any, **kw: Any) -> tuple[str, list[dict[str, Any]]]:
    """A main agent's first two turns; returns the trajectory and the history so far."""
    msgs = [{"role": "system", "content": CLAUDE}, {"role": "user", "content": "Fix the test"}]
    read = _tool_call("toolu_1", "Read", {"file_path": "test_x.py"})
    tid = await store.record_call(MAIN_LANE(make_call, msgs, read, **kw))
    msgs = [*msgs, read, {"role": "tool", "tool_call_id": "toolu_1", "content": "def test(): ..."}]
    assert await store.record_call(MAIN_LANE(make_call, msgs, "Found it.", **kw)) == tid
    return tid, [*msgs, {"role": "assistant", "content": "Found it."}]


async def test_compaction_continues_the_session_with_a_boundary(
    store: Store, make_call: Any
) -> None:
    tid, history = await _two_turns(store, make_call)
    # The summarisation call repeats the history: the chain finds it, no boundary.
    summary = "Summary: the user asked to fix test_x.py; it was read."
    compact = [*history, {"role": "user", "content": SUMMARISE}]
    assert await store.record_call(MAIN_LANE(make_call, compact, summary)) == tid
    # Then the rewritten history: found by the lane only.
    rewritten = [
        {"role": "system", "content": CLAUDE.replace("2026-12-05", "2026-12-06")},
        {"role": "user", "content": f"This session is being continued. {summary}"},
        {"role": "user", "content": "<system-reminder>def test(): ...</system-reminder>"},
        {"role": "user", "content": "Now run it"},
    ]
    assert await store.record_call(MAIN_LANE(make_call, rewritten, "Running.")) == tid
    # And the turn after goes on by the chain again.
    after = [*rewritten, {"role": "assistant", "content": "Running."}]
    after += [{"role": "user", "content": "thanks"}]
    assert await store.record_call(MAIN_LANE(make_call, after, "bye")) == tid

    detail = await store.get_trajectory(tid)
    assert detail is not None and detail.summary.turn_count == 5
    assert [t.history_rewritten for t in detail.turns] == [False, False, False, True, False]
    assert detail.summary.parent_trajectory_id is None
    assert detail.summary.session_lane is not None
    assert "sess-1" not in detail.summary.session_lane
    stored = await store.get_call(detail.turns[3].call_id)
    assert stored is not None and stored.history_rewritten


async def test_a_summarising_call_without_tools_leaves_the_trajectory_its_agent(
    store: Store, make_call: Any
) -> None:
    """Codex 0.171 sends its compaction call without tools (the chain finds it); the session
    then goes on from the summary with its tools again. The trajectory stays the agent that
    opened it, so the rewritten history still finds it by the lane."""
    tid, history = await _two_turns(store, make_call)
    compact = [*history, {"role": "user", "content": SUMMARISE}]
    summary = make_call(compact, "Summary: test_x.py was read.", tools=None, session_lane="sess-1")
    assert await store.record_call(summary) == tid
    rewritten = [
        {"role": "system", "content": CLAUDE},
        {"role": "user", "content": "Another model began this task; its summary: ..."},
        {"role": "user", "content": "Now run it"},
    ]
    assert await store.record_call(MAIN_LANE(make_call, rewritten, "Running.")) == tid
    detail = await store.get_trajectory(tid)
    assert detail is not None
    assert [t.history_rewritten for t in detail.turns] == [False, False, False, True]


async def test_sub_agents_are_their_own_trajectories_with_the_main_one_as_parent(
    store: Store, make_call: Any
) -> None:
    main, history = await _two_turns(store, make_call)
    subs = []
    for agent in ("agent-a", "agent-b"):
        sub = _session(session_lane=f"sess-1/{agent}", parent_lane="sess-1")
        msgs = [{"role": "system", "content": "You are a search agent."}]
        msgs += [{"role": "user", "content": "Find the tests"}]
        tid = await store.record_call(sub(make_call, msgs, _tool_call("toolu_9", "Bash", {})))
        cont = [*msgs, _tool_call("toolu_9", "Bash", {})]
        cont += [{"role": "tool", "tool_call_id": "toolu_9", "content": "tests/"}]
        assert await store.record_call(sub(make_call, cont, "tests/ has them")) == tid
        subs.append(tid)
    assert len({main, *subs}) == 3
    for tid in subs:
        detail = await store.get_trajectory(tid)
        assert detail is not None and detail.summary.turn_count == 2
        assert detail.summary.parent_trajectory_id == main
        assert not any(t.history_rewritten for t in detail.turns)
    # The main agent goes on with the sub-agents' answers, by the chain.
    cont = [*history, {"role": "user", "content": "go on"}]
    assert await store.record_call(MAIN_LANE(make_call, cont, "done")) == main
    page = await store.list_trajectories(parent=main)
    assert sorted(t.id for t in page.items) == sorted(subs)


async def test_another_agent_in_the_session_is_its_own_trajectory_with_a_parent(
    store: Store, make_call: Any
) -> None:
    """OpenCode's title call: same session header, another system prompt, no tools."""
    main, _ = await _two_turns(store, make_call)
    title = [{"role": "system", "content": "Generate a short title."}]
    title += [{"role": "user", "content": "Fix the test"}]
    side = await store.record_call(make_call(title, "Fixing a test", session_lane="sess-1"))
    assert side != main
    detail = await store.get_trajectory(side)
    assert detail is not None and detail.summary.parent_trajectory_id == main
    # A rewritten history of the main agent still finds the main trajectory, not the title.
    rewritten = [{"role": "system", "content": CLAUDE}, {"role": "user", "content": "Summary."}]
    assert await store.record_call(MAIN_LANE(make_call, rewritten, "ok")) == main


async def test_a_title_linked_before_the_first_answer_is_no_ones_parent(
    store: Store, make_call: Any
) -> None:
    """Calls are linked when they end: OpenCode's title ends before the main agent's first
    answer. Neither is the other's parent then (a side call has no tools; the agent has)."""
    title = [{"role": "system", "content": "Generate a short title."}]
    title += [{"role": "user", "content": "Fix the test"}]
    side = await store.record_call(make_call(title, "Fixing a test", session_lane="sess-1"))
    main, _ = await _two_turns(store, make_call)
    assert main != side
    for tid in (main, side):
        detail = await store.get_trajectory(tid)
        assert detail is not None and detail.summary.parent_trajectory_id is None


async def test_lanes_of_different_api_keys_never_link(store: Store, make_call: Any) -> None:
    mine, _ = await _two_turns(store, make_call, owner_key_id="k1")
    rewritten = [{"role": "system", "content": CLAUDE}, {"role": "user", "content": "Summary."}]
    theirs = await store.record_call(MAIN_LANE(make_call, rewritten, owner_key_id="k2"))
    assert theirs != mine
    detail = await store.get_trajectory(theirs)
    assert detail is not None and detail.summary.parent_trajectory_id is None
    assert not detail.turns[0].history_rewritten
    sub = _session(session_lane="sess-1/agent-a", parent_lane="sess-1")
    sub_tid = await store.record_call(sub(make_call, rewritten, owner_key_id="k3"))
    detail = await store.get_trajectory(sub_tid)
    assert detail is not None and detail.summary.parent_trajectory_id is None


async def test_without_session_headers_a_rewritten_history_starts_a_trajectory(
    store: Store, make_call: Any
) -> None:
    no_lane = _session(session_lane=None)
    msgs = [{"role": "system", "content": CLAUDE}, {"role": "user", "content": "Fix the test"}]
    tid = await store.record_call(no_lane(make_call, msgs, "Looking."))
    rewritten = [{"role": "system", "content": CLAUDE}, {"role": "user", "content": "Summary."}]
    other = await store.record_call(no_lane(make_call, rewritten, "ok"))
    assert other != tid
    for t in (tid, other):
        detail = await store.get_trajectory(t)
        assert detail is not None
        assert detail.summary.parent_trajectory_id is None
        assert detail.summary.session_lane is None and detail.summary.agent_signature is None
        assert not any(turn.history_rewritten for turn in detail.turns)


async def test_the_chain_wins_over_the_lane(store: Store, make_call: Any) -> None:
    """Two open trajectories of one agent in one lane: a call that continues the older by the
    chain goes there, not to the newest of the lane, and marks no boundary."""
    older, history = await _two_turns(store, make_call)
    fresh = [{"role": "system", "content": CLAUDE}, {"role": "user", "content": "New task"}]
    newer = await store.record_call(MAIN_LANE(make_call, fresh, explicit_trajectory_id="b"))
    assert newer == "b"
    cont = [*history, {"role": "user", "content": "go on"}]
    assert await store.record_call(MAIN_LANE(make_call, cont, "done")) == older
    detail = await store.get_trajectory(older)
    assert detail is not None and not any(t.history_rewritten for t in detail.turns)
    # Nothing chains: the most recently updated trajectory of the lane and agent (now `older`).
    rewritten = [{"role": "system", "content": CLAUDE}, {"role": "user", "content": "Summary."}]
    assert await store.record_call(MAIN_LANE(make_call, rewritten)) == older


@pytest.mark.parametrize("history", [20, 200])
async def test_linking_by_lane_reads_a_bounded_number_of_rows(
    store: Store, make_call: Any, history: int
) -> None:
    """Many sessions of one agent and many side calls in one session's lane: a call of the
    session reads the newest of its lane and agent, not all of them."""
    rewritten = [{"role": "system", "content": CLAUDE}, {"role": "user", "content": "Summary."}]
    for i in range(history):
        await store.record_call(_session(session_lane=f"other-{i}")(make_call, rewritten))
        side = [{"role": "system", "content": "Title"}, {"role": "user", "content": f"t{i}"}]
        await store.record_call(make_call(side, f"title {i}", session_lane="sess-1"))
    main = await store.record_call(MAIN_LANE(make_call, rewritten, "first"))
    tid, rows = await _rows_per_call(store, MAIN_LANE(make_call, rewritten, "again"))
    assert tid == main
    assert rows <= 4, f"read {rows} trajectory rows after {history} sessions"
    sub = _session(session_lane="sess-1/agent-a", parent_lane="sess-1")
    tid, rows = await _rows_per_call(store, sub(make_call, rewritten))
    detail = await store.get_trajectory(tid)
    assert detail is not None and detail.summary.parent_trajectory_id == main
    assert rows <= 4, f"read {rows} trajectory rows after {history} sessions"


async def test_a_trajectory_from_before_lanes_gets_its_lane_at_its_next_call(
    db: Database, make_call: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Trajectories stored before m012 have no lane: they continue by the chain, and their next
    call with a lane gives them one."""
    msgs = [{"role": "system", "content": CLAUDE}, {"role": "user", "content": "Fix the test"}]
    first = MAIN_LANE(make_call, msgs, "Looking.")
    assert await _stored_before(db, monkeypatch, 11, first) == [
        m.name for m in migrations.MIGRATIONS[11:]
    ]  # m012 and after

    store = await db.open()
    rewritten = [{"role": "system", "content": CLAUDE}, {"role": "user", "content": "Summary."}]
    assert await store.record_call(MAIN_LANE(make_call, rewritten)) != "t-old"  # no lane yet
    cont = [*msgs, {"role": "assistant", "content": "Looking."}, {"role": "user", "content": "go"}]
    assert await store.record_call(MAIN_LANE(make_call, cont, "ok")) == "t-old"
    detail = await store.get_trajectory("t-old")
    assert detail is not None and detail.summary.session_lane is not None
