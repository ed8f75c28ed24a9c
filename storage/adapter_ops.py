"""The SQL of adapter versions: what the trainer wrote and what serving made of it.

Write functions run inside the group-commit writer's transaction; reads take a read connection.
Callers go through `storage.store.Store`; nothing else should import this module.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from sqlalchemy import Row, insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from storage.models import adapters_table as A
from storage.records import AdapterRecord

UPDATABLE = frozenset(
    {"path", "status", "loaded_at", "activated_at", "error", "metrics", "rollout"}
)


async def record_adapter(conn: AsyncConnection, record: AdapterRecord) -> None:
    """Insert the version, or overwrite it if that version number was recorded before."""
    key = (A.c.policy == record.policy, A.c.version == record.version)
    exists = (await conn.execute(select(A.c.version).where(*key))).first()
    values = asdict(record)
    if exists is None:
        await conn.execute(insert(A).values(**values))
    else:
        await conn.execute(update(A).where(*key).values(**values))


async def update_adapter(
    conn: AsyncConnection, policy: str, version: int, changes: dict[str, Any], now: float
) -> bool:
    unknown = set(changes) - UPDATABLE
    if unknown:
        raise ValueError(f"cannot update adapter fields {sorted(unknown)}")
    result = await conn.execute(
        update(A)
        .where(A.c.policy == policy, A.c.version == version)
        .values(**changes, updated_at=now)
    )
    return result.rowcount == 1


def _record(row: Row[Any]) -> AdapterRecord:
    return AdapterRecord(
        policy=row.policy,
        version=row.version,
        path=row.path,
        status=row.status,
        created_at=row.created_at,
        updated_at=row.updated_at,
        loaded_at=row.loaded_at,
        activated_at=row.activated_at,
        error=row.error,
        metrics=row.metrics,
        rollout=row.rollout,
    )


async def list_adapters(conn: AsyncConnection, policy: str) -> list[AdapterRecord]:
    rows = await conn.execute(select(A).where(A.c.policy == policy).order_by(A.c.version))
    return [_record(r) for r in rows]


async def latest_adapter(conn: AsyncConnection, policy: str) -> AdapterRecord | None:
    """The newest version recorded for `policy` (one indexed row, however many exist)."""
    row = (
        await conn.execute(
            select(A).where(A.c.policy == policy).order_by(A.c.version.desc()).limit(1)
        )
    ).first()
    return None if row is None else _record(row)
