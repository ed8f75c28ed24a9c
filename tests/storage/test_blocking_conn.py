"""The writer's handlers run on a blocking connection (`storage.blocking_conn`), and the SQLite
store's writer runs each batch in its own thread that way."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from storage.blocking_conn import BlockingConnection, HandlerSuspended, run_inline
from storage.records import CallRecord
from storage.store import Store


def _engine(tmp_path: Path):  # type: ignore[no-untyped-def]
    return create_engine(f"sqlite+pysqlite:///{tmp_path / 'x.db'}")


def test_a_handler_that_only_awaits_its_connection_runs_to_its_result(tmp_path: Path) -> None:
    async def handler(conn: BlockingConnection, payloads: list[int]) -> list[int]:
        await conn.execute(text("CREATE TABLE t (v INTEGER)"))
        await conn.execute(text("INSERT INTO t (v) VALUES (:v)"), [{"v": p} for p in payloads])
        rows = await conn.execute(text("SELECT v * 10 AS v FROM t ORDER BY v"))
        return [r.v for r in rows]

    engine = _engine(tmp_path)
    with engine.begin() as sync_conn:
        assert run_inline(handler(BlockingConnection(sync_conn), [3, 1, 2])) == [10, 20, 30]
    engine.dispose()


def test_a_handler_error_reaches_the_caller(tmp_path: Path) -> None:
    async def handler(conn: BlockingConnection) -> None:
        await conn.execute(text("SELECT * FROM no_such_table"))

    engine = _engine(tmp_path)
    with engine.begin() as sync_conn, pytest.raises(Exception, match="no_such_table"):
        run_inline(handler(BlockingConnection(sync_conn)))
    engine.dispose()


def test_a_handler_that_awaits_anything_else_is_refused() -> None:
    async def handler() -> int:
        await asyncio.sleep(0)  # suspends: not allowed on the blocking path
        return 1

    with pytest.raises(HandlerSuspended):
        run_inline(handler())


async def test_the_sqlite_writer_commits_in_its_own_thread(tmp_path: Path) -> None:
    store = await Store.open(f"sqlite+aiosqlite:///{tmp_path / 'rl.db'}")
    threads: set[str] = set()
    original = store._write_calls

    async def spy(conn, records):  # type: ignore[no-untyped-def]
        threads.add(threading.current_thread().name)
        return await original(conn, records)

    store._write_calls = spy  # type: ignore[method-assign]
    try:
        record = CallRecord(
            id="c1",
            created_at=1.0,
            finished_at=2.0,
            model_requested="m",
            engine="upstream",
            request_messages=[{"role": "user", "content": "hi"}],
        )
        tid = await store.record_call(record)
        assert (await store.get_call("c1")) is not None
        assert (await store.get_trajectory(tid)) is not None
    finally:
        await store.close()
    assert len(threads) == 1
    (name,) = threads
    assert name.startswith("rlproxy-store-writer")
