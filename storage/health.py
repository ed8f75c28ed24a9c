"""Whether the database takes writes: the reason a failed write gives, and the store's state.

    reason = unwritable_reason(exc)    # "disk full", "read-only", ... or None (the payload's fault)
    health = store.health              # WriteHealth(writable=False, reason="disk full", ...)

A failed write is either the payload's fault (a constraint, a bad value: its neighbours still
commit) or the database's (the disk is full, the file is read-only, the server is unreachable:
nothing will commit). `unwritable_reason` tells them apart from the driver's error code (SQLite's
result code, Postgres's SQLSTATE, the errno of an OSError), never from a message's wording. The
group-commit writer (`storage.writer`) keeps a `WriteHealth`: unwritable from the first such
failure, writable again when a probe (`probe_write`), tried now and then, commits; recovery
needs no restart and no client request.

Why a probe and not simply the next commit: a write that failed on a full disk leaves the space
it managed to take in SQLite's WAL file, so a small write may commit into it while the disk is
still full. The probe therefore also asks the filesystem (SQLite): less than `MIN_FREE_BYTES`
free still counts as full.
"""

from __future__ import annotations

import errno
import os
import shutil
import sqlite3
from dataclasses import dataclass

from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncConnection

# SQLite primary result codes (https://www.sqlite.org/rescode.html).
_SQLITE_REASONS = {
    8: "read-only",  # SQLITE_READONLY
    10: "I/O error",  # SQLITE_IOERR
    11: "corrupt",  # SQLITE_CORRUPT
    13: "disk full",  # SQLITE_FULL
    14: "cannot open the database file",  # SQLITE_CANTOPEN
    26: "not a database",  # SQLITE_NOTADB
}
# Postgres SQLSTATEs (https://www.postgresql.org/docs/current/errcodes-appendix.html): exact
# codes first, then classes.
_PG_REASONS = {
    "53100": "disk full",
    "25006": "read-only",
    "58030": "I/O error",
    "57P01": "server shutting down",
    "57P02": "server shutting down",
    "57P03": "server not accepting connections",
}
_PG_CLASSES = {"53": "out of resources", "08": "connection lost"}
_ERRNO_REASONS = {errno.ENOSPC: "disk full", errno.EDQUOT: "disk full", errno.EROFS: "read-only"}
MIN_FREE_BYTES = 2**20
"""Free space below which a SQLite database's filesystem counts as full (room for a few calls)."""


@dataclass(frozen=True)
class WriteHealth:
    """The store's last word on writing: a snapshot, safe to hand to any caller."""

    writable: bool = True
    reason: str | None = None
    """Why writes fail: "disk full", "read-only", "I/O error", "connection lost", ..."""
    error: str | None = None
    """The driver's message of the last failure (never the statement or its parameters)."""
    since: float | None = None
    """Epoch seconds of the first failure of this outage."""

    def describe(self) -> str:
        """One sentence for a client or a log: what is wrong and why."""
        if self.writable:
            return "the database is writable"
        detail = f" ({self.error})" if self.error and self.error != self.reason else ""
        return f"the database cannot be written: {self.reason}{detail}"


def unwritable_reason(exc: BaseException) -> str | None:
    """Why `exc` says the database takes no writes at all; None when it is about the payload."""
    orig = exc.orig if isinstance(exc, DBAPIError) else exc
    if isinstance(orig, sqlite3.Error):
        code = getattr(orig, "sqlite_errorcode", None)
        return None if code is None else _SQLITE_REASONS.get(code & 0xFF)
    sqlstate = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    if isinstance(sqlstate, str):
        return _PG_REASONS.get(sqlstate) or _PG_CLASSES.get(sqlstate[:2])
    if isinstance(orig, OSError):
        return _ERRNO_REASONS.get(orig.errno or 0, "unreachable")
    if isinstance(exc, DBAPIError) and exc.connection_invalidated:
        return "connection lost"
    return None


def driver_message(exc: BaseException) -> str:
    """The driver's own message: SQLAlchemy's str() adds the statement and its parameters
    (the stored call's content), which must not reach a health report."""
    orig = exc.orig if isinstance(exc, DBAPIError) else exc
    return str(orig).strip().splitlines()[0] if str(orig).strip() else type(orig).__name__


async def probe_write(conn: AsyncConnection) -> None:
    """The smallest real write: rewrite the first migration's row with its own values. It takes
    the write lock, dirties a page and commits (a WAL append and an fsync on SQLite), and changes
    nothing anyone reads. On SQLite it also raises ENOSPC when the database's filesystem has
    less than `MIN_FREE_BYTES` free (see the module docstring)."""
    await conn.execute(
        text(
            "UPDATE migrations SET applied_at = applied_at "
            "WHERE id = (SELECT MIN(id) FROM migrations)"
        )
    )
    if conn.dialect.name != "sqlite":
        return
    path = (
        await conn.execute(text("SELECT file FROM pragma_database_list WHERE name = 'main'"))
    ).scalar()
    if path:
        free = shutil.disk_usage(os.path.dirname(path)).free
        if free < MIN_FREE_BYTES:
            raise OSError(errno.ENOSPC, f"{free} bytes free on the database's filesystem")
