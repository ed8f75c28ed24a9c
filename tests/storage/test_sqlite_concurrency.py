"""Many writers on one SQLite file: no "database is locked", no lost acknowledged rows.

Writers are spread over several `Store` instances (separate connections, separate writer
tasks), so they contend for SQLite's write lock the way several processes would; inside a store
they share group commits. The 30-second soak is marked slow; a 3-second run is in the default
suite.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import pytest

from storage import Store

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def _agent(store: Store, make_call: Any, name: str, deadline: float, acked: list[str]) -> int:
    """One writer: runs conversations of up to 4 turns, ends or rewards each one."""
    rng = random.Random(name)
    conversations = 0
    while time.monotonic() < deadline:
        msgs: list[dict[str, Any]] = [
            {"role": "system", "content": "shared system prompt"},
            {"role": "user", "content": f"{name} task {conversations}"},
        ]
        tid = None
        for turn in range(rng.randint(1, 4)):
            answer = f"{name} answer {conversations}.{turn}"
            record = make_call(msgs, answer)
            got = await store.record_call(record)
            acked.append(record.id)
            assert tid is None or got == tid, "a writer's conversation forked"
            tid = got
            msgs = [
                *msgs,
                {"role": "assistant", "content": answer},
                {"role": "user", "content": "go on"},
            ]
        assert tid is not None
        if rng.random() < 0.5:
            await store.add_reward(tid, rng.random(), "env")
        else:
            await store.end_trajectory(tid)
        conversations += 1
    return conversations


async def _reader(store: Store, deadline: float) -> int:
    reads = 0
    while time.monotonic() < deadline:
        page = await store.list_trajectories(limit=20)
        for item in page.items[:3]:
            await store.get_trajectory(item.id)
        reads += 1
        await asyncio.sleep(0.01)
    return reads


async def _soak(
    db: Any, make_call: Any, seconds: float, writers: int = 50, stores: int = 10
) -> None:
    opened = [await db.open() for _ in range(stores)]
    acked: list[str] = []
    deadline = time.monotonic() + seconds
    started = time.monotonic()
    results = await asyncio.gather(
        *(_agent(opened[i % stores], make_call, f"w{i}", deadline, acked) for i in range(writers)),
        _reader(opened[0], deadline),
        _reader(opened[-1], deadline),
    )
    elapsed = time.monotonic() - started
    commits = sum(s.writer_stats.commits for s in opened)
    for s in opened:
        await s.close()

    check = await db.open()
    stored = await check.count_calls()
    missing = [
        cid for cid in acked[:: max(1, len(acked) // 200)] if await check.get_call(cid) is None
    ]
    open_left = await check.count_trajectories("open")
    print(
        f"\nsqlite soak: {writers} writers on {stores} stores, {elapsed:.1f} s: "
        f"{len(acked)} calls acked ({len(acked) / elapsed:.0f}/s), {stored} stored, "
        f"{commits} commits, {sum(results[:writers])} conversations, "
        f"{sum(results[writers:])} reader rounds"
    )
    assert stored == len(acked)
    assert missing == []
    assert open_left == 0
    assert await check.count_trajectories() == sum(results[:writers])


async def test_fifty_writers_short(sqlite_db: Any, make_call: Any) -> None:
    await _soak(sqlite_db, make_call, seconds=3.0)


@pytest.mark.slow
async def test_fifty_writers_thirty_seconds(sqlite_db: Any, make_call: Any) -> None:
    await _soak(sqlite_db, make_call, seconds=30.0)
