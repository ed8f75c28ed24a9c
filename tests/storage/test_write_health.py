"""A database that takes no writes: the store notices, says why, and recovers on its own.

- SQLite on a real full disk: a small tmpfs filled to ENOSPC (`tests.full_disk`; mounting needs
  root: CI and this machine run the tests as root; elsewhere the test is skipped and says why).
- Postgres gone read-only (what a failover to a standby looks like): the store's role gets
  `default_transaction_read_only` and its sessions are restarted.
- A payload's own error (a duplicate id) is not an outage.

No test waits for a fixed time: recovery is awaited by polling `Store.health`, which a probe
write every `probe_interval_s` updates.
"""

from __future__ import annotations

import asyncio
import errno
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import asyncpg
import pytest
from sqlalchemy.engine import make_url
from sqlalchemy.exc import IntegrityError

from storage import CallRecord, Store
from storage.errors import StoreUnavailable
from storage.health import unwritable_reason
from tests.full_disk import fill, small_tmpfs
from tests.storage.conftest import POSTGRES_URL, Database, _asyncpg_dsn

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    with small_tmpfs(tmp_path / "tmpfs") as mount_point:
        yield mount_point


async def until_writable(store: Store) -> None:
    while not store.health.writable:
        await asyncio.sleep(0.02)


def _call(make_call: Callable[..., CallRecord], text: str) -> CallRecord:
    return make_call([{"role": "user", "content": text}])


async def test_a_full_disk_is_noticed_reported_and_recovered(
    disk: Path, make_call: Callable[..., CallRecord]
) -> None:
    store = await Store.open(f"sqlite+aiosqlite:///{disk / 'rlproxy.db'}", probe_interval_s=0.05)
    try:
        await store.record_call(_call(make_call, "before the disk fills"))
        assert store.health.writable

        filler = fill(disk)
        with pytest.raises(StoreUnavailable) as failed:
            await store.record_call(_call(make_call, "x" * 100_000))
        assert failed.value.reason == "disk full"
        assert isinstance(failed.value.__cause__, Exception)  # the driver's error, chained
        health = store.health
        assert not health.writable and health.reason == "disk full"
        assert health.since is not None and health.error
        assert health.describe().startswith("the database cannot be written: disk full")
        # Concurrent writes all hear it, and reads still work.
        results = await asyncio.gather(
            *(store.record_call(_call(make_call, f"during {i}")) for i in range(5)),
            return_exceptions=True,
        )
        assert all(isinstance(r, StoreUnavailable) for r in results)
        assert await store.count_calls() == 1
        # The probe keeps failing while the disk is full: the state stays, `since` included.
        probes = store.writer_stats.batches
        while store.writer_stats.batches < probes + 3:
            await asyncio.sleep(0.02)
        assert not store.health.writable and store.health.since == health.since

        filler.unlink()  # the operator frees space: no restart, no client request needed
        await until_writable(store)
        await store.record_call(_call(make_call, "after the disk has room again"))
        assert await store.count_calls() == 2
    finally:
        await store.close()


@pytest.fixture
async def read_only_capable_postgres() -> AsyncIterator[tuple[str, str, asyncpg.Connection]]:
    """A role of its own (trust auth) owning a fresh schema: (store URL, schema, admin conn)."""
    role, schema = f"r_{uuid.uuid4().hex[:12]}", f"t_{uuid.uuid4().hex[:16]}"
    admin = await asyncpg.connect(_asyncpg_dsn(POSTGRES_URL))
    await admin.execute(f'CREATE ROLE "{role}" LOGIN')
    await admin.execute(f'CREATE SCHEMA "{schema}" AUTHORIZATION "{role}"')
    url = make_url(POSTGRES_URL).set(username=role).render_as_string(hide_password=False)
    try:
        yield url, schema, admin
    finally:
        await admin.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        await _restart_sessions(admin, role)
        await admin.execute(f'DROP ROLE IF EXISTS "{role}"')
        await admin.close()


async def _restart_sessions(admin: asyncpg.Connection, role: str) -> None:
    """End the role's sessions; the store's pool reconnects (pre-ping) with the role's settings."""
    await admin.execute(
        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1", role
    )


@pytest.mark.postgres
async def test_a_read_only_postgres_is_noticed_and_recovered(
    read_only_capable_postgres: tuple[str, str, asyncpg.Connection],
    make_call: Callable[..., CallRecord],
) -> None:
    url, schema, admin = read_only_capable_postgres
    role = make_url(url).username
    store = await Store.open(url, postgres_schema=schema, probe_interval_s=0.05)
    try:
        await store.record_call(_call(make_call, "before"))
        await admin.execute(f'ALTER ROLE "{role}" SET default_transaction_read_only = on')
        await _restart_sessions(admin, str(role))
        with pytest.raises(StoreUnavailable) as failed:
            await store.record_call(_call(make_call, "while read-only"))
        assert failed.value.reason == "read-only"
        assert not store.health.writable and store.health.reason == "read-only"

        await admin.execute(f'ALTER ROLE "{role}" RESET default_transaction_read_only')
        await _restart_sessions(admin, str(role))
        await until_writable(store)
        await store.record_call(_call(make_call, "after"))
        assert await store.count_calls() == 2
    finally:
        await store.close()


async def test_a_payloads_own_error_is_not_an_outage(
    db: Database, make_call: Callable[..., CallRecord]
) -> None:
    store = await db.open()
    record = _call(make_call, "twice")
    await store.record_call(record)
    with pytest.raises(IntegrityError) as failed:
        await store.record_call(record)  # the same call id again
    assert unwritable_reason(failed.value) is None
    assert store.health.writable


async def test_reasons_come_from_error_codes_not_wording() -> None:
    import sqlite3

    full = sqlite3.OperationalError("anything at all")
    full.sqlite_errorcode = 13  # type: ignore[attr-defined]
    assert unwritable_reason(full) == "disk full"
    syntax = sqlite3.OperationalError("database or disk is full")  # no code: not an outage
    assert unwritable_reason(syntax) is None
    assert unwritable_reason(OSError(errno.ENOSPC, "No space left on device")) == "disk full"
    assert unwritable_reason(ConnectionRefusedError(errno.ECONNREFUSED, "refused")) == (
        "unreachable"
    )

    class PgError(Exception):
        sqlstate = "53100"

    assert unwritable_reason(PgError()) == "disk full"
    PgError.sqlstate = "23505"  # unique_violation: the payload's fault
    assert unwritable_reason(PgError()) is None
