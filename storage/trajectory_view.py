"""The in-memory view of the trajectories one batch of calls may link to.

`load_view` reads every trajectory the linking rule (`storage.linking`) could pick for a batch,
and no other: those named by explicit ids; per prefix hash, and per tool-call hash (a rewritten
turn's ids after the same request), the newest open trajectories that continue there (the rule
takes the newest, and each call of the batch takes at most one); per session lane and agent
signature, the newest open ones (a rewritten history), and per lane, the newest of any status (a
new trajectory's parent); per
request hash, the open trajectories whose standing call could be the same turn (it started
after one of the calls did, or it failed within the retry window, or, for a call that says it is
a retry, the newest that started before it). Every lookup is a range of an index
(`ix_trajectories_prefix_lookup`, `ix_trajectories_tool_call_lookup`,
`ix_trajectories_request_lookup`, `ix_trajectories_lane_lookup`, `ix_trajectories_lane_newest`)
bounded by the batch, by
time or by failures, never by how many calls of one task are stored: linking costs the same at
100 and at 100,000 stored runs of a task. Rows are locked with FOR UPDATE on Postgres until the
batch commits (SQLite's BEGIN IMMEDIATE already excludes other writers).

`TrajectoryView` keeps them indexed by those hashes and records which rows the batch created or
changed, so `storage.write_ops` can link calls one by one in memory and write everything back at
the end. No writes happen here.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, fields
from typing import Any

from sqlalchemy import TextualSelect, select, text
from sqlalchemy.ext.asyncio import AsyncConnection

from storage.models import trajectories_table as T
from storage.records import CALL_STATUSES, CallRecord, LinkKeys, TrajectoryState

_CHUNK = 2000  # bound parameters per IN (...) query, well under SQLite's and asyncpg's limits
_LOOKUPS_PER_QUERY = 200  # bounded lookups per UNION ALL (SQLite allows 500 compound terms)


@dataclass
class LinkStats:
    """What linking has read so far (`Store.link_stats`): its cost must not grow with history."""

    calls: int = 0
    """Calls linked."""
    rows: int = 0
    """Trajectory rows read to link them (explicit, prefix and same-request candidates)."""


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
    owner_key_id: str | None
    next_tool_call_hash: str | None
    session_lane: str | None
    agent_signature: str | None
    parent_trajectory_id: str | None
    held_out: bool = False

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
            next_tool_call_hash=self.next_tool_call_hash,
            session_lane=self.session_lane,
            agent_signature=self.agent_signature,
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
        self._by_tool_calls: dict[str, set[str]] = defaultdict(set)
        self._by_request: dict[str, set[str]] = defaultdict(set)
        self._by_agent: dict[tuple[str, str | None], set[str]] = defaultdict(set)
        self._by_lane: dict[str, set[str]] = defaultdict(set)  # any status
        self.new: set[str] = set()
        self.dirty: set[str] = set()
        for t in rows:
            self.by_id[t.id] = t
            self._index(t)

    def _index(self, t: Trajectory) -> None:
        if t.session_lane is not None:
            self._by_lane[t.session_lane].add(t.id)
        if t.status == "open":
            if t.session_lane is not None:
                self._by_agent[(t.session_lane, t.agent_signature)].add(t.id)
            if t.next_prefix_hash is not None:
                self._by_next[t.next_prefix_hash].add(t.id)
            if t.next_tool_call_hash is not None:
                self._by_tool_calls[t.next_tool_call_hash].add(t.id)
            if t.last_request_hash is not None:
                self._by_request[t.last_request_hash].add(t.id)

    def _unindex(self, t: Trajectory) -> None:
        if t.session_lane is not None:
            self._by_lane[t.session_lane].discard(t.id)
            self._by_agent[(t.session_lane, t.agent_signature)].discard(t.id)
        if t.next_prefix_hash is not None:
            self._by_next[t.next_prefix_hash].discard(t.id)
        if t.next_tool_call_hash is not None:
            self._by_tool_calls[t.next_tool_call_hash].discard(t.id)
        if t.last_request_hash is not None:
            self._by_request[t.last_request_hash].discard(t.id)

    def candidates(self, keys: LinkKeys) -> list[TrajectoryState]:
        ids: set[str] = set()
        for h in keys.prefix_hashes:
            ids |= self._by_next.get(h, set())
        for h in keys.tool_call_hashes:
            ids |= self._by_tool_calls.get(h, set())
        if keys.request_hash is not None:
            ids |= self._by_request.get(keys.request_hash, set())
        if keys.session_lane is not None:
            ids |= self._by_agent.get((keys.session_lane, keys.agent_signature), set())
        return [self.by_id[i].state() for i in sorted(ids)]

    def lanes(self, keys: LinkKeys) -> list[TrajectoryState]:
        """The newest trajectory, any status, of the call's lane and of its parent lane."""
        out = []
        for lane in (keys.session_lane, keys.parent_lane):
            rows = [self.by_id[i] for i in self._by_lane.get(lane or "", ())]
            if rows:
                out.append(max(rows, key=lambda t: (t.updated_at, t.id)).state())
        return out

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
    conn: AsyncConnection,
    records: Sequence[CallRecord],
    keys: Sequence[LinkKeys],
    *,
    retry_window_s: float,
) -> TrajectoryView:
    """Every trajectory the batch may link to, row-locked on Postgres until the commit.

    All the bounded lookups go in one UNION ALL, whatever the batch or the conversations' depth
    (a conversation of k turns has k prefix hashes): on SQLite it returns the rows (BEGIN
    IMMEDIATE already excludes other writers); on Postgres the ids, whose rows a second
    statement reads FOR UPDATE (a UNION cannot be locked)."""
    lookups = _Lookups()
    explicit = sorted({r.explicit_trajectory_id for r in records if r.explicit_trajectory_id})
    for trajectory_id in explicit:  # any status: an explicit id reopens its trajectory
        lookups.add("id = {}", trajectory_id, only_open=False)
    for prefix, uses in sorted(Counter(h for k in keys for h in k.prefix_hashes).items()):
        # The rule takes the newest open trajectory per prefix hash and each call of the batch
        # takes at most one: the newest `uses` are all the batch can reach.
        lookups.add("next_prefix_hash = {}", prefix, newest=uses)
    for tool_calls, uses in sorted(Counter(h for k in keys for h in k.tool_call_hashes).items()):
        # The same for the second key, a rewritten turn's tool-call ids (storage.linking).
        lookups.add("next_tool_call_hash = {}", tool_calls, newest=uses)

    agents = Counter((k.session_lane, k.agent_signature) for k in keys if k.session_lane)
    for (lane, signature), uses in sorted(agents.items()):
        # A rewritten history joins the newest open trajectory of its lane and agent.
        lookups.add("session_lane = {} AND agent_signature = {}", lane, signature, newest=uses)
    for lane in sorted({h for k in keys for h in (k.session_lane, k.parent_lane) if h}):
        # A new trajectory's parent: the newest of its lane or of its parent lane, any status.
        lookups.add("session_lane = {}", lane, only_open=False, newest=1)

    by_request: dict[str, list[CallRecord]] = defaultdict(list)
    for record, k in zip(records, keys, strict=True):
        if k.request_hash is not None:
            by_request[k.request_hash].append(record)
    for request_hash, calls in sorted(by_request.items()):
        first = min(c.created_at for c in calls)
        # Standing calls that started after one of these did (a late earlier attempt is
        # "stale"); such a trajectory was updated after `first`. (Naming the statuses lets the
        # lookup index range over `updated_at` within each.)
        lookups.add(
            f"last_request_hash = {{}} AND last_call_status IN ({_ALL})"
            " AND updated_at > {} AND last_call_created_at > {}",
            request_hash,
            first,
            first,
        )
        # Failed standing calls that finished within the retry window (the time rule).
        if retry_window_s > 0:
            since = first - retry_window_s
            lookups.add(
                f"last_request_hash = {{}} AND last_call_status IN ({_FAILED})"
                " AND updated_at >= {} AND last_call_finished_at >= {}",
                request_hash,
                since,
                since,
            )
        # A call that says it retries (x-stainless-retry-count): the newest standing call of
        # each status that started before it.
        for call in (c for c in calls if c.retry_count > 0):
            for status in sorted(CALL_STATUSES):
                lookups.add(
                    "last_request_hash = {} AND last_call_status = {}"
                    " AND last_call_created_at <= {}",
                    request_hash,
                    status,
                    call.created_at,
                    newest=1,
                )

    found: dict[str, Trajectory] = {}
    if conn.dialect.name != "postgresql":
        for stmt in lookups.statements(ids_only=False):
            for row in await conn.execute(stmt):
                found.setdefault(row.id, Trajectory(**row._asdict()))
        return TrajectoryView(found.values())
    ids: set[str] = set()
    for stmt in lookups.statements(ids_only=True):
        ids.update(row.id for row in await conn.execute(stmt))
    columns = [T.c[n] for n in TRAJECTORY_FIELDS]
    for chunk in _chunks(ids):
        locked = select(*columns).where(T.c.id.in_(chunk)).order_by(T.c.id).with_for_update()
        for row in await conn.execute(locked):
            found[row.id] = Trajectory(**row._asdict())
    return TrajectoryView(found.values())


_ALL = ", ".join(f"'{s}'" for s in sorted(CALL_STATUSES))
_FAILED = ", ".join(f"'{s}'" for s in sorted(CALL_STATUSES - {"completed"}))


class _Lookups:
    """Bounded lookups of trajectory rows, sent as UNION ALL statements. Written as SQL text:
    building one Core subquery per lookup (a deep conversation has dozens) cost more than
    running them."""

    def __init__(self) -> None:
        self._parts: list[tuple[str, dict[str, Any]]] = []  # (condition, its bound values)

    def add(
        self, where: str, *values: Any, only_open: bool = True, newest: int | None = None
    ) -> None:
        """Rows matching `where`, each `{}` in it a bound value; `newest`: only the newest n."""
        names = [f"v{len(self._parts)}_{i}" for i in range(len(values))]
        sql = where.format(*(f":{name}" for name in names))
        if only_open:
            sql = f"status = 'open' AND {sql}"
        if newest is not None:
            sql += f" ORDER BY updated_at DESC, id DESC LIMIT {int(newest)}"
        self._parts.append((sql, dict(zip(names, values, strict=True))))

    def statements(self, *, ids_only: bool) -> Iterator[TextualSelect]:
        fields = ["id"] if ids_only else TRAJECTORY_FIELDS
        listed = ", ".join(fields)
        for start in range(0, len(self._parts), _LOOKUPS_PER_QUERY):
            chunk = self._parts[start : start + _LOOKUPS_PER_QUERY]
            sql = " UNION ALL ".join(
                f"SELECT {listed} FROM (SELECT {listed} FROM {T.name} WHERE {where}) AS q{i}"
                for i, (where, _) in enumerate(chunk)
            )
            params = {name: value for _, values in chunk for name, value in values.items()}
            yield text(sql).bindparams(**params).columns(*(T.c[n] for n in fields))
