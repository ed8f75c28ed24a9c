"""Group commit: concurrent writes share transactions, and a result means "committed"."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from sqlalchemy.exc import IntegrityError

from storage import Store

pytestmark = pytest.mark.asyncio(loop_scope="session")


def _q(i: int) -> list[dict[str, Any]]:
    return [{"role": "system", "content": "s"}, {"role": "user", "content": f"question {i}"}]


async def test_concurrent_calls_are_batched(store: Store, make_call: Any) -> None:
    records = [make_call(_q(i)) for i in range(100)]
    before = store.writer_stats.commits
    tids = await asyncio.gather(*(store.record_call(r) for r in records))
    commits = store.writer_stats.commits - before
    print(f"\ngroup commit ({store.dialect}): 100 calls -> {commits} commits")
    assert len(set(tids)) == 100
    assert await store.count_calls() == 100
    assert 1 <= commits < 100
    assert store.writer_stats.largest_batch > 1


async def test_acknowledged_call_is_visible_to_another_store(db: Any, make_call: Any) -> None:
    writer = await db.open()
    reader = await db.open()

    async def write_then_read(i: int) -> bool:
        record = make_call(_q(i))
        await writer.record_call(record)
        return await reader.get_call(record.id) is not None

    assert all(await asyncio.gather(*(write_then_read(i) for i in range(30))))


async def test_one_bad_write_fails_alone(store: Store, make_call: Any) -> None:
    existing = make_call(_q(0))
    await store.record_call(existing)
    good = [make_call(_q(i)) for i in range(1, 20)]
    duplicate = make_call(_q(99), id=existing.id)  # primary key violation
    results = await asyncio.gather(
        *(store.record_call(r) for r in [*good[:10], duplicate, *good[10:]]),
        return_exceptions=True,
    )
    errors = [r for r in results if isinstance(r, BaseException)]
    assert len(errors) == 1 and isinstance(errors[0], IntegrityError)
    assert isinstance(results[10], IntegrityError)
    assert await store.count_calls() == 20


async def test_cancelled_waiter_still_writes(db: Any, make_call: Any) -> None:
    store = await db.open()
    records = [make_call(_q(i)) for i in range(20)]
    tasks = [asyncio.create_task(store.record_call(r)) for r in records]
    await asyncio.sleep(0)
    for t in tasks[::2]:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await store.close()  # drains the queue
    assert sum(t.cancelled() for t in tasks) == 10
    other = await db.open()
    assert await other.count_calls() == 20


async def test_close_drains_pending_writes(db: Any, make_call: Any) -> None:
    store = await db.open()
    tasks = [asyncio.create_task(store.record_call(make_call(_q(i)))) for i in range(50)]
    await asyncio.sleep(0)
    await store.close()
    await asyncio.gather(*tasks)
    other = await db.open()
    assert await other.count_calls() == 50


async def test_two_stores_racing_on_explicit_ids(db: Any, make_call: Any) -> None:
    """Two replicas create and extend the same explicit trajectories at the same moment."""
    a, b = await db.open(), await db.open()
    records = [
        make_call(_q(i), explicit_trajectory_id=f"run-{i % 5}", created_at=1000.0 + i)
        for i in range(60)
    ]
    tids = await asyncio.gather(
        *((a if i % 2 else b).record_call(r) for i, r in enumerate(records))
    )
    assert tids == [f"run-{i % 5}" for i in range(60)]
    assert await a.count_trajectories() == 5
    for k in range(5):
        detail = await a.get_trajectory(f"run-{k}")
        assert detail is not None
        assert sorted(t.turn_index for t in detail.turns) == list(range(12))
