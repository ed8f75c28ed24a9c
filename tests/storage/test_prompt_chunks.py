"""Prompts stored once by content (storage/prompt_chunks.py), on SQLite and on Postgres.

A long session's stored bytes grow with its new tokens, not with its history; every reader gets
the same whole calls back (a client that edits its history included); a database migrated from
the schema before chunks reads call for call as it did; deleting a key's data deletes its chunks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncConnection

from storage import Store, migrations
from storage.engines import create_engines
from storage.export import to_finetune_line
from storage.grouping import SignatureGrouper
from storage.prompt_chunks import TOKEN_BLOCK, SplitPrompts, insert_missing, load_prompts
from storage.records import CallRecord, ChoiceRecord
from tests.storage.conftest import Database, _drop_schema, _postgres_database, make_call

pytestmark = pytest.mark.asyncio(loop_scope="session")

SYSTEM_TOKENS = 2_733
TURN_TOKENS = 114
TEMPLATE = [1, 9690, 198]  # "<|im_start|>user\n"-like ids between turns
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": f"tool_{i}",
            "description": "Reads a file of the repository and returns its text. " * 4,
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
    for i in range(8)
]


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(49_152) for _ in range(n)]


def _words(rng: random.Random, n: int) -> str:
    return " ".join(f"w{rng.randrange(10_000)}" for _ in range(n))


def session(turns: int, seed: int = 0, **overrides: Any) -> list[CallRecord]:
    """An agent's session: a 2,733-token system prompt, then `turns` calls that each resend the
    whole history plus ~114 new tokens (the answer and a new user message), and the same tool
    declarations every call."""
    rng = random.Random(seed)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": _words(rng, SYSTEM_TOKENS)},
        {"role": "user", "content": _words(rng, 40)},
    ]
    ids = _ids(rng, SYSTEM_TOKENS + 40)
    calls = []
    for turn in range(turns):
        answer = _words(rng, TURN_TOKENS - 44)
        completion = _ids(rng, TURN_TOKENS - 44)
        call = make_call(
            list(messages),
            answer,
            prompt_token_ids=list(ids),
            tools=TOOLS,
            usage={"prompt_tokens": len(ids), "completion_tokens": len(completion)},
            **overrides,
        )
        call.choices[0].completion_token_ids = completion
        call.choices[0].completion_logprobs = [-0.25] * len(completion)
        calls.append(call)
        user = {"role": "user", "content": f"turn {turn}: {_words(rng, 40)}"}
        messages += [{"role": "assistant", "content": answer}, user]
        ids += completion + TEMPLATE + _ids(rng, 41)
    return calls


def as_read(record: CallRecord) -> CallRecord:
    """What a reader gets back for a stored record: the fields kept elsewhere or not at all
    (the owner is the trajectory's, samples have their own reads, telemetry's timing) unset."""
    return dataclasses.replace(
        record, owner_key_id=None, shadow_samples=[], time_to_first_token_s=None
    )


def _content_bytes(record: CallRecord) -> int:
    """The prompt's JSON: what the rows before chunks held of it, every call."""
    prompt = (record.request_messages, record.tools, record.prompt_token_ids)
    return sum(len(json.dumps(part)) for part in prompt)


async def test_a_long_sessions_bytes_grow_with_new_tokens_not_history(store: Store) -> None:
    calls = session(13)
    added, before = [], 0
    for call in calls:
        tid = await store.record_call(call)
        now = await store.trajectory_bytes(tid)
        added.append(now - before)
        before = now
    last = calls[-1]
    # The first call stores its whole prompt; every later one what is new (its new messages
    # and token ids, its answer), the token block it shares with the previous call's tail again
    # (at most TOKEN_BLOCK ids), one reference (22 characters and JSON quoting) per message,
    # tool and block, and its row's other columns (under 1 KB): nothing that grows with the
    # history but the references.
    assert _content_bytes(calls[0]) < added[0] < _content_bytes(calls[0]) + 3_000
    for turn in range(1, len(calls)):
        now_, prev = calls[turn], calls[turn - 1]
        new = now_.request_messages[len(prev.request_messages) :]
        new_ids = (now_.prompt_token_ids or [])[len(prev.prompt_token_ids or []) :]
        answer = now_.choices[0]
        blocks = len(now_.prompt_token_ids or []) // TOKEN_BLOCK + 1
        references = len(now_.request_messages) + len(TOOLS) + blocks
        bound = (
            len(json.dumps(new))
            + len(json.dumps(new_ids))
            + len(json.dumps([answer.message, answer.completion_token_ids]))
            + len(json.dumps(answer.completion_logprobs))
            + len(json.dumps(_ids(random.Random(turn), TOKEN_BLOCK)))
            + 25 * references
            + 1_000
        )
        assert added[turn] < bound, (turn, added[turn], bound)
    assert max(added[1:]) - min(added[1:]) < 1_500, added
    # What the old rows held for the same session, the whole prompt every call: 13x the first.
    whole_prompts = sum(_content_bytes(c) for c in calls)
    assert before < whole_prompts / 4, (before, whole_prompts)
    assert before < 4 * len(json.dumps({"messages": last.request_messages, "tools": TOOLS}))


async def test_every_reader_gets_the_same_whole_calls_back(store: Store) -> None:
    calls = session(30, seed=1)
    tid = ""
    for call in calls:
        tid = await store.record_call(call)
    stored = await store.get_trajectory_calls(tid)
    assert [s.record for s in stored] == [as_read(c) for c in calls]
    for call in (calls[0], calls[17], calls[-1]):
        one = await store.get_call(call.id)
        assert one is not None and one.record == as_read(call)
    detail = await store.get_trajectory(tid)
    assert detail is not None
    assert [t.request_messages for t in detail.turns] == [c.request_messages for c in calls]
    line = to_finetune_line(detail)
    assert line is not None
    assert line["messages"][:-1] == calls[-1].request_messages
    # Grouping reads the first call's messages (a second run of the task makes a group);
    # training reads every turn's exact ids.
    await store.end_trajectory(tid)
    again = session(30, seed=1)
    for call in again:
        other = await store.record_call(call)
    await store.end_trajectory(other)
    result = await store.form_groups(SignatureGrouper(min_size=2))
    group = await store.get_group(result.ready[0])
    assert group is not None
    assert [m.trajectory_id for m in group.members] == [tid, other]
    for member, run in zip(group.members, (calls, again), strict=True):
        assert member.messages[:-1] == run[-1].request_messages
        assert [t.prompt_token_ids for t in member.turns] == [c.prompt_token_ids for c in run]


async def test_a_client_that_edits_its_history_round_trips_exactly(store: Store) -> None:
    first, second = session(2, seed=2)
    await store.record_call(first)
    await store.record_call(second)
    # Compaction: the history rewritten in the middle, a message dropped, one repeated, keys in
    # another order, token ids that share the system prompt's blocks but not what follows.
    messages = [dict(m) for m in second.request_messages]
    messages[1] = {"content": "a summary of what happened", "role": "user", "name": "ü"}
    del messages[2]
    messages.append(messages[-1])
    ids = list(second.prompt_token_ids or [])
    ids = [*ids[:300], 5, 6, 7, *ids[400:], 8]
    edited = make_call(messages, "fine", prompt_token_ids=ids, tools=[{"type": "function"}])
    # The same content under another key, and a call with no token ids (a provider's).
    other = make_call(messages, "fine", prompt_token_ids=ids, owner_key_id="k2")
    upstream = make_call(messages[:2], "hi", engine="upstream", prompt_token_ids=None)
    empty = make_call([], "?", prompt_token_ids=[])
    for call in (edited, other, upstream, empty):
        await store.record_call(call)
        read = await store.get_call(call.id)
        assert read is not None and read.record == as_read(call)
    # A key's data deleted: its chunks go, the other key's calls still read whole.
    await store.delete_key_data("k2")
    assert await store.get_call(other.id) is None
    read = await store.get_call(edited.id)
    assert read is not None and read.record == as_read(edited)


# --- the migration ---------------------------------------------------------------------------

_OLD_JSON = ("request_messages", "tools", "params", "response", "prompt_token_ids", "usage")


def _old_call_row(record: CallRecord, tid: str, turn: int) -> dict[str, Any]:
    """A `calls` row as the code before m010 wrote it: the whole prompt in the row."""
    skip = {"choices", "shadow_samples", "time_to_first_token_s", "owner_key_id"}
    skip |= {"session_lane", "parent_lane"}  # never columns (the trajectory keeps a hash)
    skip |= {"held_out"}  # never a column of calls (the trajectory keeps it)
    row = {f.name: getattr(record, f.name) for f in dataclasses.fields(CallRecord)}
    row = {k: v for k, v in row.items() if k not in skip}
    for k in _OLD_JSON:
        row[k] = None if row[k] is None else json.dumps(row[k], separators=(",", ":"))
    prompt_tokens, completion_tokens = record.token_counts()
    row.update(
        recorded_at=record.finished_at,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        request_hash=None,
        trajectory_id=tid,
        turn_index=turn,
        retry_of=None,
        superseded_by=None,
    )
    return row


def _insert(conn: Any, table: str, rows: list[dict[str, Any]]) -> None:
    cols = list(rows[0])
    sql = f"INSERT INTO {table} ({', '.join(cols)}) VALUES ({', '.join(':' + c for c in cols)})"
    conn.execute(text(sql), rows)


def _write_old_rows(
    conn: Any, trajectories: dict[str, tuple[str | None, list[CallRecord]]]
) -> None:
    for tid, (owner, calls) in trajectories.items():
        last = calls[-1]
        _insert(
            conn,
            "trajectories",
            [
                {
                    "id": tid,
                    "status": "open",
                    "created_at": calls[0].created_at,
                    "updated_at": last.finished_at,
                    "turn_count": len(calls),
                    "call_count": len(calls),
                    "explicit": False,
                    "owner_key_id": owner,
                }
            ],
        )
        _insert(conn, "calls", [_old_call_row(c, tid, i) for i, c in enumerate(calls)])
        choices = [
            {
                "call_id": c.id,
                "choice_index": ch.index,
                "message": json.dumps(ch.message),
                "finish_reason": ch.finish_reason,
                "completion_token_ids": json.dumps(ch.completion_token_ids),
                "completion_logprobs": json.dumps(ch.completion_logprobs),
            }
            for c in calls
            for ch in c.choices
        ]
        if choices:
            _insert(conn, "call_choices", choices)


async def test_a_database_migrated_from_whole_prompts_reads_as_before(
    db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    keyed = session(7, seed=3)
    keyed[2].prompt_token_ids = None  # a call that had none
    keyed[4].choices.append(
        ChoiceRecord(
            index=1,
            message={"role": "assistant", "content": "-inf"},
            finish_reason="stop",
            completion_token_ids=[1],
            completion_logprobs=[float("-inf")],
        )
    )
    edited = make_call([{"role": "user", "content": "ß → ∞", "name": None}], None)
    trajectories = {
        "t-keyed": ("k1", keyed),
        "t-open": (None, session(5, seed=3)),  # the same content without a key
        "t-edited": (None, [edited]),
    }
    engines = create_engines(db.url, postgres_schema=db.schema)
    try:
        with monkeypatch.context() as m:
            m.setattr(migrations, "MIGRATIONS", migrations.MIGRATIONS[:9])
            await migrations.migrate(engines.write)
        async with engines.write.begin() as conn:
            await conn.run_sync(_write_old_rows, trajectories)
        monkeypatch.setattr(migrations, "_M010_PAGE", 4)  # several pages
        applied = await migrations.migrate(engines.write)
        assert applied == [m.name for m in migrations.MIGRATIONS[9:]]  # m010 and after
    finally:
        await engines.dispose()

    store = await db.open()
    for tid, (_, calls) in trajectories.items():
        stored = await store.get_trajectory_calls(tid)
        assert [s.record for s in stored] == [as_read(c) for c in calls], tid
    # Same content, different owners: chunks apart; the unkeyed session shares its own.
    assert (
        await store.trajectory_bytes("t-open")
        < sum(_content_bytes(c) for c in trajectories["t-open"][1]) / 2
    )
    await store.delete_key_data("k1")
    stored = await store.get_trajectory_calls("t-open")
    assert [s.record for s in stored] == [as_read(c) for c in trajectories["t-open"][1]]


async def _backend_pid(conn: AsyncConnection) -> int:
    return int((await conn.execute(text("SELECT pg_backend_pid()"))).scalar_one())


async def _until_blocked(
    monitor: AsyncConnection, pid: int, *, by: int, late: asyncio.Task[Any], timeout_s: float = 30
) -> None:
    """Wait until Postgres says backend `pid` waits on a lock `by` holds (`pg_blocking_pids`);
    fail if `late`, the task running on `pid`, finishes first or the wait outlasts
    `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    query = text("SELECT pg_blocking_pids(:pid)")
    while by not in (await monitor.execute(query, {"pid": pid})).scalar_one():
        assert not late.done(), "the second insert finished without waiting on the first"
        assert time.monotonic() < deadline, f"backend {pid} never waited on backend {by}"
        await asyncio.sleep(0.02)


@pytest.fixture
async def pg_db() -> AsyncIterator[Database]:
    database = await _postgres_database()
    try:
        yield database
    finally:
        await database.close_all()
        await _drop_schema(database.schema or "")


@pytest.mark.postgres
async def test_replicas_inserting_the_same_new_chunk_at_once_both_commit(pg_db: Database) -> None:
    """Postgres, two replicas: the second transaction's lookup cannot see the first's chunks
    (not committed yet), so its insert meets them on the primary key; it must wait and skip
    them, not fail. (SQLite runs one write transaction at a time: no such race there.)"""
    await (await pg_db.open()).close()  # migrated
    pg_db.stores.clear()
    engines = create_engines(pg_db.url, postgres_schema=pg_db.schema)
    split = SplitPrompts()
    refs = split.messages(None, session(1, seed=5)[0].request_messages)
    try:
        async with engines.write.connect() as one, engines.write.connect() as two:
            await one.begin()
            await two.begin()
            first, second = await _backend_pid(one), await _backend_pid(two)
            assert await insert_missing(one, split) == len(set(refs))
            late = asyncio.create_task(insert_missing(two, split))
            async with engines.read.connect() as monitor:
                await _until_blocked(monitor, second, by=first, late=late)
            assert not late.done()  # waiting on the first transaction's rows
            await one.commit()
            assert await late == len(set(refs))  # it looked before they were committed
            await two.commit()
        async with engines.read.connect() as conn:
            rows = [{"id": "c", "message_refs": refs, "tool_refs": None}]
            prompt = (await load_prompts(conn, [SimpleNamespace(**r) for r in rows], False))["c"]
            assert prompt.messages == session(1, seed=5)[0].request_messages
    finally:
        await engines.dispose()
