"""Running the writer's handlers, written against `AsyncConnection`, on a blocking connection.

    conn = BlockingConnection(sync_connection)       # inside the writer's own thread
    results = run_inline(handler(conn, payloads))    # the coroutine finishes in one step

The write handlers (`storage.write_ops`, `storage.group_ops`, ...) are `async def` and only ever
await their connection. Given a connection whose methods return at once, such a coroutine never
suspends, so it can be driven to its end with one `send(None)` on any thread, no event loop
needed. The group-commit writer uses this for SQLite: a batch's whole transaction runs in the
writer's thread on the standard `sqlite3` driver, one thread hop per batch, where aiosqlite
hops to its thread and back for every statement. The same handler code serves Postgres
(asyncpg, a real `AsyncConnection`) unchanged.

This is not an async adapter: a handler that awaits anything else (a sleep, a lock, another
connection) is a programming error here, and `run_inline` says so instead of blocking.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator
from typing import Any, TypeVar

from sqlalchemy import Connection, CursorResult, Dialect

T = TypeVar("T")


class BlockingConnection:
    """The part of `AsyncConnection` the handlers use, over a blocking `Connection`."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    @property
    def dialect(self) -> Dialect:
        return self._conn.dialect

    async def execute(self, statement: Any, parameters: Any = None, **kw: Any) -> CursorResult[Any]:
        return self._conn.execute(statement, parameters, **kw)

    async def exec_driver_sql(
        self, statement: str, parameters: Any = None, **kw: Any
    ) -> CursorResult[Any]:
        return self._conn.exec_driver_sql(statement, parameters, **kw)

    async def run_sync(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        return fn(self._conn, *args, **kw)


class HandlerSuspended(RuntimeError):
    """A handler run by `run_inline` awaited something that does not complete at once."""


def run_inline(awaitable: Awaitable[T]) -> T:
    """Drive `awaitable` (a handler's coroutine), which must never suspend, to its result (or
    its exception)."""
    coro: Generator[Any, None, T] = awaitable.__await__()
    try:
        coro.send(None)
    except StopIteration as done:
        result: T = done.value
        return result
    coro.close()
    raise HandlerSuspended(
        f"{awaitable!r} awaited something other than its connection; write handlers run on a "
        "blocking connection must only await the connection"
    )
