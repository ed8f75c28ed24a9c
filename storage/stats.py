"""The SQL of the figures the dashboard polls and `rlproxy status` prints.

Every query the dashboard runs on a page load is bounded: it reads an index range of a fixed
time window (calls per minute over the last hour), a fixed number of the newest rows (rewards
per adapter version over the newest `window` rewards and judge scores), or the groups still in
the pipeline (forming, ready, scoring). Aggregation happens in SQL; Python only shapes the rows.
`totals` counts whole tables and is meant for the command line, not for polling;
`trajectory_bytes` sums what one trajectory's rows hold (benchmarks of long sessions).

Callers go through `storage.store.Store`; nothing else should import this module.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Integer, case, cast, exists, func, or_, select, text
from sqlalchemy.ext.asyncio import AsyncConnection
from sqlalchemy.sql.elements import ColumnElement

from storage import read_ops
from storage.models import calls_table as C
from storage.models import group_members_table as GM
from storage.models import groups_table as G
from storage.models import rewards_table as R
from storage.models import scores_table as S
from storage.models import trajectories_table as T
from storage.records import POLICY_ENGINES

PIPELINE_STATUSES = ("forming", "ready", "scoring")
"""Group statuses that are still on their way to training (few at any time)."""


@dataclass(frozen=True)
class MinuteCount:
    """Calls that started within one minute (`start`, epoch seconds, inclusive)."""

    start: float
    calls: int
    errors: int
    """Calls that did not complete (`error`, `client_disconnected`)."""


@dataclass(frozen=True)
class VersionReward:
    """Rewards of the trajectories (or shadow samples) one adapter version served.

    `version` 0 is the base model. The version of a trajectory is the one that served its first
    call; a shadow sample's is its call's. `source` is "explicit" (the environment's rewards, the
    latest per trajectory) or "ruler" (the judge's scores, the latest per group member).
    """

    version: int
    source: str
    n: int
    mean: float
    stderr: float | None
    """Standard error of the mean (sample std / sqrt(n)); None for a single reward."""


@dataclass(frozen=True)
class GroupMark:
    """The newest group in one status: when it got there and, for a failure, why."""

    id: str
    at: float
    failure: str | None = None


@dataclass(frozen=True)
class Waiting:
    """Where traffic stands that has not reached training, and since when: what `rlproxy
    status` and the dashboard read to say why nothing trains (`proxy.telemetry.waiting`)."""

    alone: int = 0
    """Trajectories alone in a forming task or explicit group (no second run of their task)."""
    alone_since: float | None = None
    """When the oldest of them started waiting."""
    alone_cohort: int = 0
    """Trajectories alone in a forming cohort group (their agent sent nothing else)."""
    small: int = 0
    """Trajectories in forming groups of 2 or more that have not reached the ready size."""
    small_since: float | None = None
    unrewarded_ready: int = 0
    """Ready groups (among the newest few) with a member that has no explicit reward: only a
    judge can score them."""
    equal_rewards: int = 0
    """Scored groups (among the newest few) a step skipped: every member got the same reward."""
    held: int = 0
    """Groups whose judge failed its checks: scored, not trained on."""
    open_trajectories: int = 0
    """Trajectories still open: not ended, rewarded or idle long enough to close."""


@dataclass(frozen=True)
class GroupQueue:
    """Groups on their way to training, and the judge's latest result."""

    counts: dict[str, int]
    """Groups per pipeline status (forming, ready, scoring)."""
    untrained_scored: int
    """Scored groups no training step has used yet, among the newest `untrained_window`."""
    untrained_window: int
    last_scored: GroupMark | None
    last_failed: GroupMark | None
    waiting: Waiting = Waiting()


@dataclass(frozen=True)
class Totals:
    """Whole-table counts (`rlproxy status`)."""

    calls: int
    calls_failed: int
    trajectories: dict[str, int]
    groups: dict[str, int]
    rewards: int
    scores: int
    groups_trained: int
    """Groups a training step used (skipped ones, `trained_step = 0`, are not counted)."""


def _minute_index(column: ColumnElement[Any], since: float, dialect: str) -> ColumnElement[Any]:
    """floor((column - since) / 60) as an integer; `column >= since` holds in every row."""
    offset = (column - since) / 60.0
    # SQLite's CAST truncates, which is floor for the non-negative offsets here; Postgres's
    # rounds, so it floors first.
    return cast(func.floor(offset) if dialect == "postgresql" else offset, Integer)


async def calls_per_minute(
    conn: AsyncConnection,
    *,
    now: float,
    minutes: int,
    owner: str | None,
    dialect: str,
) -> list[MinuteCount]:
    """Calls (and failed calls) per minute over the last `minutes`, oldest first, every minute
    present. Reads the `created_at` index range of the window only."""
    since = now - 60.0 * minutes
    bucket = _minute_index(C.c.created_at, since, dialect).label("bucket")
    failed = func.sum(case((C.c.status == "completed", 0), else_=1))
    stmt = select(bucket, func.count().label("calls"), failed.label("errors")).where(
        C.c.created_at >= since, C.c.created_at <= now
    )
    if owner is not None:
        stmt = stmt.where(C.c.api_key_id == owner)
    rows = (await conn.execute(stmt.group_by(bucket))).all()
    found = {min(int(r.bucket), minutes - 1): r for r in rows}
    out = []
    for i in range(minutes):
        row = found.get(i)
        out.append(
            MinuteCount(
                start=since + 60.0 * i,
                calls=int(row.calls) if row else 0,
                errors=int(row.errors or 0) if row else 0,
            )
        )
    return out


def _first_call(trajectory_id: ColumnElement[Any]) -> Any:
    """The id of a trajectory's first call (an index lookup per row)."""
    calls = C.alias("first_calls")  # not the outer query's `calls`, which it must not correlate
    return (
        select(calls.c.id)
        .where(calls.c.trajectory_id == trajectory_id)
        .order_by(calls.c.turn_index, calls.c.created_at)
        .limit(1)
        .scalar_subquery()
    )


def member_call() -> Any:
    """The call a group member's version is read from: its own call (a shadow sample), else its
    trajectory's first call. Shared with `storage.rollout`."""
    return case((GM.c.call_id.is_not(None), GM.c.call_id), else_=_first_call(GM.c.trajectory_id))


SERVED_VERSION = func.coalesce(C.c.adapter_version, 0).label("version")
"""The version that served a call (0: the base model), read with the call joined in."""


async def reward_by_version(
    conn: AsyncConnection, *, window: int, owner: str | None
) -> list[VersionReward]:
    """Mean and standard error of rewards per adapter version, over the newest `window`
    explicit rewards and the newest `window` judge scores (each source on its own). Only what
    the policy served counts: runs that began on an upstream model are left out."""
    explicit = await _aggregate(conn, _explicit_rewards(window, owner), "explicit")
    ruler = await _aggregate(conn, _judge_scores(window, owner), "ruler")
    return sorted(explicit + ruler, key=lambda v: (v.version, v.source))


def _explicit_rewards(window: int, owner: str | None) -> Any:
    """(version, value) per trajectory: its latest reward among the newest `window`."""
    recent = select(R.c.id, R.c.trajectory_id, R.c.reward).order_by(R.c.id.desc()).limit(window)
    recent_cte = recent.cte("recent_rewards")
    latest = select(func.max(recent_cte.c.id)).group_by(recent_cte.c.trajectory_id)
    stmt = (
        select(SERVED_VERSION, recent_cte.c.reward.label("value"))
        .select_from(recent_cte)
        .join(C, C.c.id == _first_call(recent_cte.c.trajectory_id))
        .where(recent_cte.c.id.in_(latest), C.c.engine.in_(POLICY_ENGINES))
    )
    if owner is not None:
        stmt = stmt.join(T, T.c.id == recent_cte.c.trajectory_id).where(T.c.owner_key_id == owner)
    return stmt.cte("explicit_values")


def _judge_scores(window: int, owner: str | None) -> Any:
    """(version, value) per group member: its latest score among the newest `window`. A
    trajectory member counts for its first call's version, a sampled answer for its call's."""
    recent = select(S.c.id, S.c.group_id, S.c.member_id, S.c.score).order_by(S.c.id.desc())
    recent_cte = recent.limit(window).cte("recent_scores")
    latest = select(func.max(recent_cte.c.id)).group_by(
        recent_cte.c.group_id, recent_cte.c.member_id
    )
    stmt = (
        select(SERVED_VERSION, recent_cte.c.score.label("value"))
        .select_from(recent_cte)
        .join(
            GM,
            (GM.c.group_id == recent_cte.c.group_id) & (GM.c.member_id == recent_cte.c.member_id),
        )
        .join(C, C.c.id == member_call())
        .where(recent_cte.c.id.in_(latest), C.c.engine.in_(POLICY_ENGINES))
    )
    if owner is not None:
        stmt = stmt.join(T, T.c.id == GM.c.trajectory_id).where(T.c.owner_key_id == owner)
    return stmt.cte("judge_values")


async def _aggregate(conn: AsyncConnection, values: Any, source: str) -> list[VersionReward]:
    """Per version: n, mean, and the sum of squared deviations (two passes, in SQL, so that
    the variance does not lose precision as E[x²] − E[x]² would)."""
    means = (
        select(
            values.c.version,
            func.count().label("n"),
            func.avg(values.c.value).label("mean"),
        )
        .group_by(values.c.version)
        .cte(f"{source}_means")
    )
    stmt = (
        select(
            means.c.version,
            means.c.n,
            means.c.mean,
            func.sum((values.c.value - means.c.mean) * (values.c.value - means.c.mean)).label("ss"),
        )
        .join(means, means.c.version == values.c.version)
        .group_by(means.c.version, means.c.n, means.c.mean)
    )
    out = []
    for row in await conn.execute(stmt):
        n, ss = int(row.n), float(row.ss or 0.0)
        stderr = math.sqrt(ss / (n - 1)) / math.sqrt(n) if n > 1 else None
        out.append(VersionReward(int(row.version), source, n, float(row.mean), stderr))
    return out


async def group_queue(
    conn: AsyncConnection, *, owner: str | None, untrained_window: int
) -> GroupQueue:
    """Pipeline counts through the (status, created_at) index, and the newest scored and
    failed group; scored-but-untrained groups are counted among the newest few only."""

    def owned(stmt: Any) -> Any:
        return stmt if owner is None else stmt.where(G.c.owner_key_id == owner)

    counts = dict.fromkeys(PIPELINE_STATUSES, 0)
    rows = await conn.execute(
        owned(
            select(G.c.status, func.count().label("n"))
            .where(G.c.status.in_(PIPELINE_STATUSES))
            .group_by(G.c.status)
        )
    )
    counts.update({r.status: int(r.n) for r in rows})
    newest_scored = (
        owned(select(G.c.trained_step).where(G.c.status == "scored"))
        .order_by(G.c.created_at.desc())
        .limit(untrained_window)
        .subquery()
    )
    untrained = await conn.execute(
        select(func.count())
        .select_from(newest_scored)
        .where(newest_scored.c.trained_step.is_(None))
    )

    async def newest(status: str) -> GroupMark | None:
        stmt = owned(select(G.c.id, G.c.scored_at, G.c.updated_at, G.c.failure)).where(
            G.c.status == status
        )
        row = (await conn.execute(stmt.order_by(G.c.created_at.desc()).limit(1))).first()
        if row is None:
            return None
        return GroupMark(row.id, row.scored_at or row.updated_at, row.failure)

    skipped = await conn.execute(
        select(func.count()).select_from(newest_scored).where(newest_scored.c.trained_step == 0)
    )
    return GroupQueue(
        counts=counts,
        untrained_scored=int(untrained.scalar_one()),
        untrained_window=untrained_window,
        last_scored=await newest("scored"),
        last_failed=await newest("failed"),
        waiting=await _waiting(conn, owned, owner, int(skipped.scalar_one()), untrained_window),
    )


async def _waiting(
    conn: AsyncConnection, owned: Any, owner: str | None, equal_rewards: int, window: int
) -> Waiting:
    """Forming groups (few: they turn ready or move on within a window) by size; the newest
    `window` ready groups that need a judge; held groups and open trajectories by index."""
    forming = await conn.execute(
        owned(
            select(
                G.c.source,
                G.c.member_count,
                func.count().label("groups"),
                func.min(G.c.created_at).label("since"),
            )
            .where(G.c.status == "forming", G.c.member_count > 0)
            .group_by(G.c.source, G.c.member_count)
        )
    )
    alone = alone_cohort = small = 0
    alone_since: float | None = None
    small_since: float | None = None
    for source, members, groups, since in forming:
        if members > 1:
            small += int(members) * int(groups)
            small_since = since if small_since is None else min(small_since, since)
        elif source == "cohort":
            alone_cohort += int(groups)
        else:
            alone += int(groups)
            alone_since = since if alone_since is None else min(alone_since, since)
    newest_ready = (
        owned(select(G.c.id).where(G.c.status == "ready"))
        .order_by(G.c.created_at.desc())
        .limit(window)
        .subquery()
    )
    rewarded = exists().where(R.c.trajectory_id == GM.c.trajectory_id)
    unrewarded = exists().where(
        GM.c.group_id == newest_ready.c.id, or_(GM.c.call_id.is_not(None), ~rewarded)
    )
    needs_judge = await conn.execute(
        select(func.count()).select_from(newest_ready).where(unrewarded)
    )
    held = await conn.execute(owned(select(func.count()).where(G.c.status == "held")))
    open_stmt = select(func.count()).select_from(T).where(T.c.status == "open")
    if owner is not None:
        open_stmt = open_stmt.where(T.c.owner_key_id == owner)
    return Waiting(
        alone=alone,
        alone_since=alone_since,
        alone_cohort=alone_cohort,
        small=small,
        small_since=small_since,
        unrewarded_ready=int(needs_judge.scalar_one()),
        equal_rewards=equal_rewards,
        held=int(held.scalar_one()),
        open_trajectories=int((await conn.execute(open_stmt)).scalar_one()),
    )


async def totals(conn: AsyncConnection) -> Totals:
    """Whole-table counts: a scan of each table's smallest index (for the command line)."""

    async def count(stmt: Any) -> int:
        return int((await conn.execute(stmt)).scalar_one())

    return Totals(
        calls=await count(select(func.count()).select_from(C)),
        calls_failed=await count(
            select(func.count()).select_from(C).where(C.c.status != "completed")
        ),
        trajectories=await read_ops.status_counts(conn, T),
        groups=await read_ops.status_counts(conn, G),
        rewards=await count(select(func.count()).select_from(R)),
        scores=await count(select(func.count()).select_from(S)),
        groups_trained=await count(select(func.count()).select_from(G).where(G.c.trained_step > 0)),
    )


@dataclass(frozen=True)
class JudgeWork:
    """What the judge did since a time: groups it judged (scored or failed; rewards alone are
    not judging), its calls (attempts, re-orderings included) and their wall time."""

    since: float
    groups: int
    calls: int
    seconds: float


async def judge_work(conn: AsyncConnection, *, since: float) -> JudgeWork:
    """Groups judged since `since` (scanned: for the command line)."""
    judged = G.c.judge_model.is_not(None) & (G.c.judge_model != "explicit")
    stmt = select(
        func.count(),
        func.coalesce(func.sum(G.c.judge_attempts), 0),
        func.coalesce(func.sum(G.c.judge_latency_s), 0.0),
    ).where(judged, G.c.scored_at >= since)
    groups, calls, seconds = (await conn.execute(stmt)).one()
    return JudgeWork(since, int(groups), int(calls), float(seconds))


def _value_bytes(value: Any) -> int:
    """A stored value's size as SQLite's `length(CAST(v AS BLOB))` gives it: text by its UTF-8
    bytes, a number by its text."""
    if value is None:
        return 0
    if isinstance(value, str):
        return len(value.encode())
    if isinstance(value, bytes):
        return len(value)
    return len(str(value))


def trajectory_bytes(conn: Connection, trajectory_id: str) -> int:
    """Bytes one trajectory's rows hold, summed over their columns: the trajectory, its calls,
    choices and shadow samples, and every prompt chunk its calls refer to (each once; a chunk
    shared with other trajectories, such as a system prompt, is counted here too). Synchronous,
    for a benchmark or `AsyncConnection.run_sync`; indexes and page slack are not counted."""
    where = {"t": trajectory_id}
    total = 0
    refs: set[str] = set()
    for sql in (
        "SELECT * FROM trajectories WHERE id = :t",
        "SELECT * FROM calls WHERE trajectory_id = :t",
        "SELECT x.* FROM call_choices x JOIN calls c ON c.id = x.call_id "
        "WHERE c.trajectory_id = :t",
        "SELECT x.* FROM call_samples x JOIN calls c ON c.id = x.call_id "
        "WHERE c.trajectory_id = :t",
    ):
        for row in conn.execute(text(sql), where).mappings():
            total += sum(_value_bytes(v) for v in row.values())
            for column in ("message_refs", "tool_refs", "token_refs"):
                if row.get(column):
                    refs.update(json.loads(row[column]))
    hashes = sorted(refs)
    for i in range(0, len(hashes), 500):
        part = {f"h{j}": h for j, h in enumerate(hashes[i : i + 500])}
        marks = ", ".join(f":{k}" for k in part)
        rows = conn.execute(text(f"SELECT * FROM prompt_chunks WHERE hash IN ({marks})"), part)
        total += sum(_value_bytes(v) for row in rows.mappings() for v in row.values())
    return total
