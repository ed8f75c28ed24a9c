"""The in-memory view of the trajectories one batch of calls may link to.

`load_view` reads, in a few IN (...) queries, every trajectory a batch could touch: those named
by explicit ids and the open ones whose `next_prefix_hash` or `last_request_hash` matches a
call's hashes (row-locked with FOR UPDATE on Postgres until the batch commits; SQLite's BEGIN
IMMEDIATE already excludes other writers). `TrajectoryView` keeps them indexed by those hashes
and records which rows the batch created or changed, so `storage.write_ops` can link calls one
by one in memory and write everything back at the end. No writes happen here.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncConnection

from storage.models import trajectories_table as T
from storage.records import CallRecord, LinkKeys, TrajectoryState

_CHUNK = 2000  # bound parameters per IN (...) query, well under SQLite's and asyncpg's limits


@dataclass
class Trajectory:
    """A trajectory row as the batch sees it (loaded, then changed in memory)."""

    id: str
    status: str
    created_at: float
    updated_at: float
    closed_at: float | None
    close_reason: str | None
    group_key: str | None
    model: str | None
    turn_count: int
    call_count: int
    explicit: bool
    task_signature: str | None
    next_prefix_hash: str | None
    last_request_hash: str | None
    last_call_id: str | None
    last_call_created_at: float | None
    last_call_finished_at: float | None
    last_call_status: str | None

    def state(self) -> TrajectoryState:
        return TrajectoryState(
            id=self.id,
            status="open" if self.status == "open" else "closed",
            created_at=self.created_at,
            updated_at=self.updated_at,
            turn_count=self.turn_count,
            next_prefix_hash=self.next_prefix_hash,
            last_request_hash=self.last_request_hash,
            last_call_id=self.last_call_id,
            last_call_created_at=self.last_call_created_at,
            last_call_finished_at=self.last_call_finished_at,
            last_call_status=self.last_call_status,
        )


TRAJECTORY_FIELDS = [f.name for f in fields(Trajectory)]


def _chunks(values: Iterable[str]) -> Iterator[list[str]]:
    items = sorted(set(values))
    for i in range(0, len(items), _CHUNK):
        yield items[i : i + _CHUNK]


class TrajectoryView:
    """Trajectories the batch may touch, indexed by their linking hashes (open ones only)."""

    def __init__(self, rows: Iterable[Trajectory]) -> None:
        self.by_id: dict[str, Trajectory] = {}
        self._by_next: dict[str, set[str]] = defaultdict(set)
        self._by_request: dict[str, set[str]] = defaultdict(set)
        self.new: set[str] = set()
        self.dirty: set[str] = set()
        for t in rows:
            self.by_id[t.id] = t
            self._index(t)

    def _index(self, t: Trajectory) -> None:
        if t.status == "open":
            if t.next_prefix_hash is not None:
                self._by_next[t.next_prefix_hash].add(t.id)
            if t.last_request_hash is not None:
                self._by_request[t.last_request_hash].add(t.id)

    def _unindex(self, t: Trajectory) -> None:
        if t.next_prefix_hash is not None:
            self._by_next[t.next_prefix_hash].discard(t.id)
        if t.last_request_hash is not None:
            self._by_request[t.last_request_hash].discard(t.id)

    def candidates(self, keys: LinkKeys) -> list[TrajectoryState]:
        ids: set[str] = set()
        for h in keys.prefix_hashes:
            ids |= self._by_next.get(h, set())
        if keys.request_hash is not None:
            ids |= self._by_request.get(keys.request_hash, set())
        return [self.by_id[i].state() for i in sorted(ids)]

    def change(self, t: Trajectory, **values: Any) -> None:
        self._unindex(t)
        for name, value in values.items():
            setattr(t, name, value)
        self._index(t)
        if t.id not in self.new:
            self.dirty.add(t.id)

    def add(self, t: Trajectory) -> None:
        self.by_id[t.id] = t
        self.new.add(t.id)
        self._index(t)


async def load_view(
    conn: AsyncConnection, records: Sequence[CallRecord], keys: Sequence[LinkKeys]
) -> TrajectoryView:
    """Every trajectory the batch may link to, row-locked on Postgres until the commit."""
    queries = [
        (T.c.id, [r.explicit_trajectory_id for r in records if r.explicit_trajectory_id], False),
        (T.c.next_prefix_hash, [h for k in keys for h in k.prefix_hashes], True),
        (T.c.last_request_hash, [k.request_hash for k in keys if k.request_hash], True),
    ]
    rows: dict[str, Trajectory] = {}
    for column, values, only_open in queries:
        for chunk in _chunks(values):
            stmt = select(*(T.c[n] for n in TRAJECTORY_FIELDS)).where(column.in_(chunk))
            if only_open:
                stmt = stmt.where(T.c.status == "open")
            for row in await conn.execute(stmt.order_by(T.c.id).with_for_update()):
                rows.setdefault(row.id, Trajectory(**row._asdict()))
    return TrajectoryView(rows.values())
