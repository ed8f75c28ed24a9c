"""The SQL that lets several serving replicas on one database act as one deployment.

- Leases (`leases`): a named job only one process runs at a time (the trainer, publishing).
  Taking one is a single conditional UPDATE (the row is free, expired, or already ours) or,
  for a name never leased before, an INSERT that does nothing on a conflict: on Postgres two
  replicas racing for it serialise on the row, on SQLite on the write lock; exactly one wins.
- The policy's state (`policy_state`): the active version (0: the base model) and the canary
  on trial beside it, one row per policy that every replica reads on each poll.
- Replicas (`replicas`): each replica's heartbeat and the adapter versions it keeps loaded.

Times are the callers' clocks (epoch seconds): replicas on several machines need clocks in
step to well under a lease's length (NTP does it). Write functions run inside the
group-commit writer's transaction; reads take a read connection. Callers go through
`storage.store.Store`; nothing else should import this module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import case, delete, or_, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncConnection

from storage.models import leases_table as L
from storage.models import policy_state_table as P
from storage.models import replicas_table as R


@dataclass(frozen=True)
class LeaseRecord:
    name: str
    holder: str
    acquired_at: float
    expires_at: float


@dataclass(frozen=True)
class PolicyStateRecord:
    policy: str
    active_version: int
    """0: the base model."""
    canary_version: int | None
    canary_share: float | None
    changed_at: float
    changed_by: str | None


@dataclass(frozen=True)
class ReplicaRecord:
    id: str
    policy: str
    versions: tuple[int, ...]
    started_at: float
    heartbeat_at: float


def _insert(conn: AsyncConnection, table: Any) -> Any:
    dialect = postgresql if conn.dialect.name == "postgresql" else sqlite
    return dialect.insert(table)


async def acquire_lease(
    conn: AsyncConnection, name: str, holder: str, ttl_s: float, now: float
) -> bool:
    """Take or renew `name` for `holder` until now + ttl_s: True when `holder` holds it."""
    taken = await conn.execute(
        update(L)
        .where(L.c.name == name, or_(L.c.holder == holder, L.c.expires_at < now))
        .values(
            holder=holder,
            expires_at=now + ttl_s,
            # a renewal keeps the time it was taken; a takeover starts a new one
            acquired_at=case((L.c.holder == holder, L.c.acquired_at), else_=now),
        )
    )
    if taken.rowcount == 1:
        return True
    inserted = await conn.execute(
        _insert(conn, L)
        .values(name=name, holder=holder, acquired_at=now, expires_at=now + ttl_s)
        .on_conflict_do_nothing(index_elements=["name"])
    )
    return inserted.rowcount == 1


async def release_lease(conn: AsyncConnection, name: str, holder: str) -> bool:
    """Give `name` up if `holder` holds it (another replica may take it at once)."""
    result = await conn.execute(delete(L).where(L.c.name == name, L.c.holder == holder))
    return result.rowcount == 1


async def get_lease(conn: AsyncConnection, name: str) -> LeaseRecord | None:
    row = (await conn.execute(select(L).where(L.c.name == name))).first()
    if row is None:
        return None
    return LeaseRecord(row.name, row.holder, row.acquired_at, row.expires_at)


async def set_policy_state(
    conn: AsyncConnection,
    policy: str,
    changes: dict[str, Any],
    by: str | None,
    now: float,
    expect: dict[str, Any] | None = None,
) -> bool:
    """Change the policy's row (active_version, canary_version, canary_share), creating it
    (active: the base model, no canary) when there is none. With `expect` (field: value, None
    meaning NULL) only a row that still has those values changes (compare-and-set; a missing
    row counts as holding them): False when it did not."""
    fields = {"active_version", "canary_version", "canary_share"}
    unknown = (set(changes) | set(expect or {})) - fields
    if unknown:
        raise ValueError(f"cannot set policy state fields {sorted(unknown)}")
    values = {**changes, "changed_at": now, "changed_by": by}
    where = [P.c.policy == policy]
    for name, value in (expect or {}).items():
        where.append(P.c[name].is_(None) if value is None else P.c[name] == value)
    updated = await conn.execute(update(P).where(*where).values(**values))
    if updated.rowcount == 1:
        return True
    row = {"policy": policy, "active_version": 0, **(expect or {}), **values}
    if expect is None:
        await conn.execute(
            _insert(conn, P)
            .values(**row)
            .on_conflict_do_update(index_elements=["policy"], set_=values)
        )
        return True
    inserted = await conn.execute(
        _insert(conn, P).values(**row).on_conflict_do_nothing(index_elements=["policy"])
    )
    return inserted.rowcount == 1


async def get_policy_state(conn: AsyncConnection, policy: str) -> PolicyStateRecord | None:
    row = (await conn.execute(select(P).where(P.c.policy == policy))).first()
    if row is None:
        return None
    return PolicyStateRecord(
        policy=row.policy,
        active_version=row.active_version,
        canary_version=row.canary_version,
        canary_share=row.canary_share,
        changed_at=row.changed_at,
        changed_by=row.changed_by,
    )


async def heartbeat_replica(
    conn: AsyncConnection, replica_id: str, policy: str, versions: list[int], now: float
) -> None:
    values = {"policy": policy, "versions": sorted(versions), "heartbeat_at": now}
    await conn.execute(
        _insert(conn, R)
        .values(id=replica_id, started_at=now, **values)
        .on_conflict_do_update(index_elements=["id"], set_=values)
    )


async def remove_replica(conn: AsyncConnection, replica_id: str) -> None:
    await conn.execute(delete(R).where(R.c.id == replica_id))


async def live_replicas(conn: AsyncConnection, policy: str, since: float) -> list[ReplicaRecord]:
    """Replicas of `policy` whose heartbeat is not older than `since`."""
    rows = await conn.execute(
        select(R).where(R.c.policy == policy, R.c.heartbeat_at >= since).order_by(R.c.id)
    )
    return [
        ReplicaRecord(
            id=r.id,
            policy=r.policy,
            versions=tuple(int(v) for v in (r.versions or [])),
            started_at=r.started_at,
            heartbeat_at=r.heartbeat_at,
        )
        for r in rows
    ]
