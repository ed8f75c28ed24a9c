"""Engine setup for the two supported backends: SQLite (aiosqlite) and Postgres (asyncpg).

SQLite gets three engines on the same file:
- the *write* engine, one pooled connection, whose transactions start with BEGIN IMMEDIATE, so a
  writer takes the write lock up front and waits (busy_timeout) instead of failing with
  "database is locked" when it later tries to upgrade a read lock (migrations use it);
- the *write thread* engine: the same, but blocking (the standard `sqlite3` driver), for the
  group-commit writer, which runs each batch's whole transaction in its own thread: one thread
  hop per batch instead of one per statement (aiosqlite), which is what a call's commit cost
  on a busy machine;
- the *read* engine, whose transactions start with a plain (deferred) BEGIN, so readers never
  take the write lock; in WAL mode they do not block the writer or each other.

All use SQLAlchemy's documented recipe for pysqlite/aiosqlite: turn off the driver's own
transaction handling (`isolation_level = None`) and emit BEGIN ourselves in the "begin" event.

Durability: `synchronous=FULL` by default. In WAL mode NORMAL already keeps every committed
transaction when the *process* is killed (the WAL pages are in the OS page cache), but a power
loss or OS crash can drop the last commits; FULL fsyncs the WAL at every commit, so an
acknowledged call survives power loss too. Group commit makes that one fsync per batch of calls,
not per call, which is why FULL costs little here.

Postgres uses one asyncpg engine for reads and writes with the server's defaults
(READ COMMITTED, synchronous_commit=on). This module only builds engines; it runs no queries
beyond connection pragmas.
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass
from typing import Any, Literal

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

SqliteSynchronous = Literal["FULL", "NORMAL"]


@dataclass
class Engines:
    write: AsyncEngine
    read: AsyncEngine
    dialect: str  # "sqlite" | "postgresql"
    write_thread: Engine | None = None
    """SQLite only: the group-commit writer's blocking engine, run in its own thread so that a
    whole batch costs one hop off the event loop (aiosqlite hops once per statement)."""

    async def dispose(self) -> None:
        await self.write.dispose()
        if self.read is not self.write:
            await self.read.dispose()
        if self.write_thread is not None:
            self.write_thread.dispose()


def _sqlite_engine(
    url: str, *, immediate: bool, busy_timeout_s: float, synchronous: SqliteSynchronous, **kw: Any
) -> AsyncEngine:
    engine = create_async_engine(url, connect_args={"timeout": busy_timeout_s}, **kw)
    _sqlite_events(engine.sync_engine, immediate, busy_timeout_s, synchronous)
    return engine


def _sqlite_thread_engine(
    url: str, *, busy_timeout_s: float, synchronous: SqliteSynchronous
) -> Engine:
    """The writer's engine: the standard library's `sqlite3` (pysqlite) on the same file, one
    connection, used from the writer's own thread only (`storage.writer`)."""
    engine = create_engine(
        make_url(url).set(drivername="sqlite+pysqlite"),
        connect_args={"timeout": busy_timeout_s, "check_same_thread": False},
        pool_size=1,
        max_overflow=0,
    )
    _sqlite_events(engine, True, busy_timeout_s, synchronous)
    return engine


def _sqlite_events(
    engine: Engine, immediate: bool, busy_timeout_s: float, synchronous: SqliteSynchronous
) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, connection_record: Any) -> None:
        # Stop the driver from issuing its own BEGIN; _on_begin below emits ours.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        _set_wal(cursor, busy_timeout_s)
        cursor.execute(f"PRAGMA synchronous={synchronous}")
        cursor.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")


def _set_wal(cursor: Any, busy_timeout_s: float) -> None:
    """`PRAGMA journal_mode=WAL`, retried while another connection holds the lock it needs.

    SQLite answers "database is locked" at once, without its busy handler, when two connections
    switch a new file to WAL together (several processes or stores opening one fresh database);
    the mode is persistent, so once one of them succeeds the others' switch is a no-op."""
    deadline = time.monotonic() + busy_timeout_s
    delay = 0.005
    while True:
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() + delay > deadline:
                raise
        time.sleep(delay)  # a connect callback: synchronous, on the driver's own thread
        delay = min(delay * 2, 0.2)


def create_engines(
    url: str,
    *,
    busy_timeout_s: float = 10.0,
    sqlite_synchronous: SqliteSynchronous = "FULL",
    pool_size: int = 5,
    postgres_schema: str | None = None,
) -> Engines:
    """Build the engines for `url` ("sqlite+aiosqlite:///path" or "postgresql+asyncpg://...").

    `postgres_schema` puts every table in that (existing) schema via the search_path.
    """
    backend = make_url(url).get_backend_name()
    if backend == "sqlite":
        if make_url(url).database in (None, "", ":memory:"):
            raise ValueError(
                "an in-memory SQLite database cannot be shared between the store's writer and "
                "readers; give a file path, e.g. sqlite+aiosqlite:///rlproxy-data/rlproxy.db"
            )
        opts: dict[str, Any] = {
            "busy_timeout_s": busy_timeout_s,
            "synchronous": sqlite_synchronous,
        }
        write = _sqlite_engine(url, immediate=True, pool_size=1, max_overflow=0, **opts)
        read = _sqlite_engine(url, immediate=False, pool_size=pool_size, **opts)
        thread = _sqlite_thread_engine(url, **opts)
        return Engines(write=write, read=read, dialect="sqlite", write_thread=thread)
    if backend == "postgresql":
        connect_args: dict[str, Any] = {}
        if postgres_schema is not None:
            connect_args["server_settings"] = {"search_path": postgres_schema}
        engine = create_async_engine(
            url, pool_size=pool_size, pool_pre_ping=True, connect_args=connect_args
        )
        return Engines(write=engine, read=engine, dialect="postgresql")
    raise ValueError(
        f"unsupported database URL {url!r}: use sqlite+aiosqlite:///... or postgresql+asyncpg://..."
    )
