"""The store's public API on both backends: round trips, ends, rewards, paging, export."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import pytest

from storage import (
    CallRecord,
    ChoiceRecord,
    InvalidRecord,
    Store,
    StoreClosed,
    TrajectoryNotFound,
)
from storage.export import to_finetune_line, to_finetune_lines

pytestmark = pytest.mark.asyncio(loop_scope="session")

SYSTEM = {"role": "system", "content": "You are a careful agent."}


def _q(text: str) -> list[dict[str, Any]]:
    return [SYSTEM, {"role": "user", "content": text}]


async def test_call_round_trips_exactly(store: Store, make_call: Any) -> None:
    record: CallRecord = make_call(
        _q("hello"),
        tools=[{"type": "function", "function": {"name": "f", "parameters": {"b": 1, "a": 2}}}],
        adapter_version=3,
        api_key_id="key-1",
        stream=True,
        token_ids_note=None,
        response={"id": "chatcmpl-1", "object": "chat.completion", "choices": []},
        prompt_token_ids=list(range(5000)),
        params={"temperature": 0.7, "n": 2, "stop": ["\n"], "unicode": "héllo ✓"},
    )
    record.choices.append(
        ChoiceRecord(
            index=1,
            message={"role": "assistant", "content": "second", "refusal": None},
            finish_reason="length",
            completion_token_ids=[2**31 + 7, 0, 151645],
            completion_logprobs=[-math.inf, -1e-300, -0.1 + 0.2],
        )
    )
    tid = await store.record_call(record)
    stored = await store.get_call(record.id)
    assert stored is not None
    assert stored.record == record
    assert stored.trajectory_id == tid
    assert stored.turn_index == 0
    assert stored.retry_of is None and stored.superseded_by is None
    assert await store.get_call("missing") is None


async def test_error_call_without_choices(store: Store, make_call: Any) -> None:
    record = make_call(_q("boom"), answer=None, token_ids_note="provider returned no token ids")
    tid = await store.record_call(record)
    stored = await store.get_call(record.id)
    assert stored is not None and stored.record == record
    detail = await store.get_trajectory(tid)
    assert detail is not None
    assert detail.turns[0].status == "error"
    assert detail.turns[0].response_messages == []


async def test_invalid_record_is_rejected(store: Store, make_call: Any) -> None:
    with pytest.raises(InvalidRecord):
        await store.record_call(make_call(_q("x"), status="done"))
    with pytest.raises(InvalidRecord):
        await store.record_call(make_call(_q("x"), id=""))
    assert await store.count_calls() == 0


async def test_get_trajectory_turns_and_token_counts(store: Store, make_call: Any) -> None:
    first = make_call(_q("count"), "1", adapter_version=None)
    tid = await store.record_call(first)
    history = [
        *_q("count"),
        {"role": "assistant", "content": "1"},
        {"role": "user", "content": "+1"},
    ]
    second = make_call(history, "2", adapter_version=4, usage=None, prompt_token_ids=[1] * 9)
    assert await store.record_call(second) == tid

    detail = await store.get_trajectory(tid)
    assert detail is not None
    assert detail.summary.turn_count == 2 and detail.summary.call_count == 2
    assert detail.summary.status == "open" and detail.summary.model == "policy"
    assert [t.call_id for t in detail.turns] == [first.id, second.id]
    assert [t.turn_index for t in detail.turns] == [0, 1]
    assert detail.turns[1].request_messages == history
    assert detail.turns[1].response_messages == [{"role": "assistant", "content": "2"}]
    assert (detail.turns[0].prompt_tokens, detail.turns[0].completion_tokens) == (4, 3)
    assert (detail.turns[1].prompt_tokens, detail.turns[1].completion_tokens) == (9, 3)
    assert [t.adapter_version for t in detail.turns] == [None, 4]
    assert detail.rewards == []
    assert await store.get_trajectory("missing") is None
    assert await store.count_calls(tid) == 2


async def test_end_and_rewards_close(store: Store, make_call: Any) -> None:
    a = await store.record_call(make_call(_q("a")))
    b = await store.record_call(make_call(_q("b")))
    assert await store.end_trajectory(a) is True
    assert await store.end_trajectory(a) is False

    r1 = await store.add_reward(b, 0.25, "env")
    r2 = await store.add_reward(b, 0.75, "ruler", explanation="better than the others")
    assert r2 > r1
    detail = await store.get_trajectory(b)
    assert detail is not None
    assert detail.summary.status == "closed" and detail.summary.close_reason == "reward"
    assert [(r.reward, r.source, r.explanation) for r in detail.rewards] == [
        (0.25, "env", None),
        (0.75, "ruler", "better than the others"),
    ]
    end = await store.get_trajectory(a)
    assert end is not None and end.summary.close_reason == "end" and end.summary.closed_at

    with pytest.raises(TrajectoryNotFound):
        await store.end_trajectory("nope")
    with pytest.raises(TrajectoryNotFound):
        await store.add_reward("nope", 1.0, "env")
    for bad in (1e308, -1e7, float("nan"), float("inf")):
        with pytest.raises(InvalidRecord, match="finite number"):
            await store.add_reward(b, bad, "env")
    assert await store.count_trajectories("closed") == 2


async def test_close_idle(store: Store, make_call: Any) -> None:
    old = await store.record_call(make_call(_q("old")))
    await asyncio.sleep(0.05)
    import time

    cutoff_now = time.time()
    fresh = await store.record_call(make_call(_q("fresh")))
    closed = await store.close_idle(0.0, now=cutoff_now)
    assert closed == [old]
    assert await store.close_idle(3600) == []
    detail = await store.get_trajectory(old)
    assert detail is not None and detail.summary.close_reason == "idle"
    fresh_detail = await store.get_trajectory(fresh)
    assert fresh_detail is not None and fresh_detail.summary.status == "open"


async def test_list_trajectories_keyset_paging(store: Store, make_call: Any) -> None:
    ids = []
    for i in range(7):
        call = make_call(_q(f"task {i}"), created_at=1000.0 + (i // 2))  # ties on created_at
        ids.append(await store.record_call(call))
    seen: list[str] = []
    cursor = None
    pages = 0
    while True:
        page = await store.list_trajectories(limit=3, cursor=cursor)
        seen += [t.id for t in page.items]
        pages += 1
        if pages == 1:  # a trajectory arriving mid-paging neither repeats nor shifts rows
            await store.record_call(make_call(_q("late"), created_at=2000.0))
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
    assert pages == 3
    assert len(seen) == len(set(seen)) == 7
    assert set(seen) == set(ids)
    created = {}
    for tid in seen:
        d = await store.get_trajectory(tid)
        assert d is not None
        created[tid] = d.summary.created_at
    assert seen == sorted(seen, key=lambda t: (created[t], t), reverse=True)

    with pytest.raises(ValueError):
        await store.list_trajectories(cursor="garbage!")


async def test_list_trajectories_filters(store: Store, make_call: Any) -> None:
    a = await store.record_call(make_call(_q("a"), created_at=100.0, explicit_group_key="g1"))
    b = await store.record_call(make_call(_q("b"), created_at=200.0, model_requested="other"))
    c = await store.record_call(make_call(_q("c"), created_at=300.0))
    await store.end_trajectory(c)

    async def ids(**kw: Any) -> list[str]:
        return [t.id for t in (await store.list_trajectories(**kw)).items]

    assert await ids() == [c, b, a]
    assert await ids(status="closed") == [c]
    assert await ids(status="open") == [b, a]
    assert await ids(group_key="g1") == [a]
    assert await ids(model="other") == [b]
    assert await ids(since=150.0) == [c, b]
    assert await ids(until=250.0) == [b, a]
    assert await ids(since=150.0, until=250.0) == [b]


async def test_export_finetune_lines(store: Store, make_call: Any) -> None:
    tools = [{"type": "function", "function": {"name": "search", "parameters": {}}}]
    call_1 = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "search", "arguments": '{"q": "x"}'},
            }
        ],
        "refusal": None,
    }
    msgs = [{"role": "developer", "content": "sys"}, {"role": "user", "content": "find x"}]
    tid = await store.record_call(make_call(msgs, call_1, tools=tools))
    msgs2 = [*msgs, call_1, {"role": "tool", "tool_call_id": "call_1", "content": "x=1"}]
    assert await store.record_call(make_call(msgs2, "x is 1", tools=tools)) == tid
    await store.add_reward(tid, 1.0, "env")
    await store.record_call(make_call(_q("still open")))

    exported = [d async for d in store.iter_trajectories_for_export()]
    assert [d.id for d in exported] == [tid]
    line = to_finetune_line(exported[0])
    assert line is not None
    json.dumps(line)
    assert line["tools"] == tools
    assert line["messages"] == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "find x"},
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "search", "arguments": '{"q": "x"}'},
                }
            ],
        },
        {"role": "tool", "content": "x=1", "tool_call_id": "call_1"},
        {"role": "assistant", "content": "x is 1"},
    ]


async def test_export_writes_each_part_of_a_rewritten_history(store: Store, make_call: Any) -> None:
    """A coding agent that compacted its history: the turns before the rewrite and the turns
    after it are each a whole conversation, one line each (the last turn alone would drop the
    first part)."""
    tools = [{"type": "function", "function": {"name": "Read", "parameters": {}}}]
    first = _q("fix the test")
    tid = await store.record_call(make_call(first, "Read it.", tools=tools, session_lane="s"))
    second = [*first, {"role": "assistant", "content": "Read it."}]
    second += [{"role": "user", "content": "go"}]
    assert (
        await store.record_call(make_call(second, "Done half.", tools=tools, session_lane="s"))
        == tid
    )
    rewritten = [SYSTEM, {"role": "user", "content": "Summary: half done."}]
    assert (
        await store.record_call(make_call(rewritten, "Done all.", tools=tools, session_lane="s"))
        == tid
    )
    await store.end_trajectory(tid)
    (detail,) = [d async for d in store.iter_trajectories_for_export()]
    assert [t.history_rewritten for t in detail.turns] == [False, False, True]
    lines = to_finetune_lines(detail)
    assert [line["messages"][-1]["content"] for line in lines] == ["Done half.", "Done all."]
    assert lines[0]["messages"][1:] == [
        {"role": "user", "content": "fix the test"},
        {"role": "assistant", "content": "Read it."},
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "Done half."},
    ]
    assert lines[1]["messages"][1]["content"] == "Summary: half done."
    assert lines[-1] == to_finetune_line(detail)


async def test_closed_store_refuses_writes(db: Any, make_call: Any) -> None:
    store = await db.open()
    await store.close()
    with pytest.raises(StoreClosed):
        await store.record_call(make_call(_q("late")))
