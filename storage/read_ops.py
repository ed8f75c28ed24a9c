"""The SQL of every read: trajectory pages, trajectory detail, single calls, counts.

Functions take an `AsyncConnection` (the store opens it on its read engine) and return the plain
records of `storage.records`. Paging is keyset paging on (created_at, id), newest first, so a
page never repeats or skips a row when new trajectories arrive meanwhile. Callers go through
`storage.store.Store`; nothing else should import this module.
"""

from __future__ import annotations

import base64
import json
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Row, Table, and_, func, or_, select
from sqlalchemy.ext.asyncio import AsyncConnection

from storage.models import call_choices_table as CC
from storage.models import calls_table as C
from storage.models import rewards_table as R
from storage.models import trajectories_table as T
from storage.prompt_chunks import Prompt, load_prompts
from storage.records import (
    CallRecord,
    ChoiceRecord,
    RewardRecord,
    StoredCall,
    TrajectoryDetail,
    TrajectoryPage,
    TrajectorySummary,
    TurnView,
)


@dataclass(frozen=True)
class TrajectoryFilter:
    status: str | None = None
    group_key: str | None = None
    model: str | None = None
    since: float | None = None
    """Created at or after (epoch seconds)."""
    until: float | None = None
    """Created before (epoch seconds)."""
    owner: str | None = None
    """Only this API key's trajectories (None: every one)."""
    parent: str | None = None
    """Only the trajectories this one started (`parent_trajectory_id`)."""


def encode_cursor(created_at: float, trajectory_id: str) -> str:
    raw = json.dumps([created_at, trajectory_id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


MAX_CURSOR_CHARS = 512
"""Cursors this store writes are under 100 characters; a longer one is not one of them."""


def decode_cursor(cursor: str) -> tuple[float, str]:
    """(created_at, id) from a cursor of `encode_cursor`; ValueError for anything else."""
    if len(cursor) > MAX_CURSOR_CHARS:
        raise ValueError(f"invalid cursor (longer than {MAX_CURSOR_CHARS} characters)")
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        created_at, trajectory_id = json.loads(raw)
        at = float(created_at)
        if not math.isfinite(at) or not isinstance(trajectory_id, str):
            raise ValueError("not a (time, id) pair")
        return at, trajectory_id
    except (ValueError, TypeError, OverflowError, RecursionError) as e:
        raise ValueError(f"invalid cursor {cursor!r}") from e


def _summary(row: Row[Any]) -> TrajectorySummary:
    return TrajectorySummary(
        id=row.id,
        status=row.status,
        created_at=row.created_at,
        updated_at=row.updated_at,
        closed_at=row.closed_at,
        close_reason=row.close_reason,
        group_key=row.group_key,
        model=row.model,
        turn_count=row.turn_count,
        call_count=row.call_count,
        task_signature=row.task_signature,
        explicit=bool(row.explicit),
        owner_key_id=row.owner_key_id,
        parent_trajectory_id=row.parent_trajectory_id,
        session_lane=row.session_lane,
        agent_signature=row.agent_signature,
        held_out=bool(row.held_out),
    )


async def list_trajectories(
    conn: AsyncConnection, f: TrajectoryFilter, limit: int, cursor: str | None
) -> TrajectoryPage:
    if limit < 1:
        raise ValueError("limit must be at least 1")
    stmt = select(T)
    if f.status is not None:
        stmt = stmt.where(T.c.status == f.status)
    if f.group_key is not None:
        stmt = stmt.where(T.c.group_key == f.group_key)
    if f.model is not None:
        stmt = stmt.where(T.c.model == f.model)
    if f.owner is not None:
        stmt = stmt.where(T.c.owner_key_id == f.owner)
    if f.parent is not None:
        stmt = stmt.where(T.c.parent_trajectory_id == f.parent)
    if f.since is not None:
        stmt = stmt.where(T.c.created_at >= f.since)
    if f.until is not None:
        stmt = stmt.where(T.c.created_at < f.until)
    if cursor is not None:
        c_at, c_id = decode_cursor(cursor)
        stmt = stmt.where(or_(T.c.created_at < c_at, and_(T.c.created_at == c_at, T.c.id < c_id)))
    stmt = stmt.order_by(T.c.created_at.desc(), T.c.id.desc()).limit(limit + 1)
    rows = (await conn.execute(stmt)).all()
    items = [_summary(r) for r in rows[:limit]]
    next_cursor = None
    if len(rows) > limit:
        last = items[-1]
        next_cursor = encode_cursor(last.created_at, last.id)
    return TrajectoryPage(items=items, next_cursor=next_cursor)


def _choice(row: Row[Any]) -> ChoiceRecord:
    return ChoiceRecord(
        index=row.choice_index,
        message=row.message,
        finish_reason=row.finish_reason,
        completion_token_ids=row.completion_token_ids,
        completion_logprobs=row.completion_logprobs,
    )


def _call(row: Row[Any], prompt: Prompt, choices: list[ChoiceRecord]) -> StoredCall:
    record = CallRecord(
        id=row.id,
        request_id=row.request_id,
        created_at=row.created_at,
        finished_at=row.finished_at,
        model_requested=row.model_requested,
        adapter_version=row.adapter_version,
        engine=row.engine,
        request_messages=prompt.messages,
        tools=prompt.tools,
        params=row.params,
        response=row.response,
        choices=choices,
        prompt_token_ids=prompt.token_ids,
        usage=row.usage,
        latency_s=row.latency_s,
        status=row.status,
        error=row.error,
        api_key_id=row.api_key_id,
        stream=bool(row.stream),
        token_ids_note=row.token_ids_note,
        explicit_trajectory_id=row.explicit_trajectory_id,
        explicit_group_key=row.explicit_group_key,
        retry_count=row.retry_count,
        completion_id=row.completion_id,
        protocol=row.protocol or "chat",
        retrievable=row.retrievable,
    )
    return StoredCall(
        record=record,
        trajectory_id=row.trajectory_id,
        turn_index=row.turn_index,
        recorded_at=row.recorded_at,
        retry_of=row.retry_of,
        superseded_by=row.superseded_by,
        history_rewritten=bool(row.history_rewritten),
    )


async def _choices_for(conn: AsyncConnection, call_ids: list[str]) -> dict[str, list[ChoiceRecord]]:
    out: dict[str, list[ChoiceRecord]] = defaultdict(list)
    if call_ids:
        rows = await conn.execute(
            select(CC).where(CC.c.call_id.in_(call_ids)).order_by(CC.c.call_id, CC.c.choice_index)
        )
        for r in rows:
            out[r.call_id].append(_choice(r))
    return out


async def read_calls(conn: AsyncConnection, rows: Sequence[Row[Any]]) -> list[StoredCall]:
    """Whole calls from `calls` rows: their prompts joined from their chunks, their choices."""
    prompts = await load_prompts(conn, rows)
    choices = await _choices_for(conn, [r.id for r in rows])
    return [_call(r, prompts[r.id], choices[r.id]) for r in rows]


async def get_call(conn: AsyncConnection, call_id: str) -> StoredCall | None:
    row = (await conn.execute(select(C).where(C.c.id == call_id))).first()
    return None if row is None else (await read_calls(conn, [row]))[0]


async def calls_of(conn: AsyncConnection, trajectory_id: str) -> list[StoredCall]:
    """Every call of a trajectory, retries included, in (turn, recording) order."""
    rows = (
        await conn.execute(
            select(C)
            .where(C.c.trajectory_id == trajectory_id)
            .order_by(C.c.turn_index, C.c.recorded_at, C.c.id)
        )
    ).all()
    return await read_calls(conn, rows)


def _attempts_by_turn(calls: list[StoredCall]) -> dict[int, list[StoredCall]]:
    by_turn: dict[int, list[StoredCall]] = defaultdict(list)
    for c in calls:
        by_turn[c.turn_index].append(c)
    return dict(sorted(by_turn.items()))


def _standing(attempts: list[StoredCall]) -> StoredCall:
    """The call that stands for a turn: the last one no retry superseded."""
    return ([c for c in attempts if c.superseded_by is None] or attempts)[-1]


def standing_calls(calls: list[StoredCall]) -> list[StoredCall]:
    """One call per turn, in turn order: the one that stands for it (retries resolved)."""
    return [_standing(attempts) for attempts in _attempts_by_turn(calls).values()]


def _turns(calls: list[StoredCall]) -> list[TurnView]:
    turns = []
    for index, attempts in _attempts_by_turn(calls).items():
        call = _standing(attempts)
        rec = call.record
        prompt, completion = rec.token_counts()
        turns.append(
            TurnView(
                turn_index=index,
                call_id=rec.id,
                request_messages=rec.request_messages,
                response_messages=[c.message for c in rec.choices],
                tools=rec.tools,
                prompt_tokens=prompt,
                completion_tokens=completion,
                adapter_version=rec.adapter_version,
                model_requested=rec.model_requested,
                status=rec.status,
                latency_s=rec.latency_s,
                created_at=rec.created_at,
                retry_of=call.retry_of,
                attempts=len(attempts),
                protocol=rec.protocol,
                completion_id=rec.completion_id,
                history_rewritten=call.history_rewritten,
            )
        )
    return turns


async def get_trajectory(conn: AsyncConnection, trajectory_id: str) -> TrajectoryDetail | None:
    row = (await conn.execute(select(T).where(T.c.id == trajectory_id))).first()
    if row is None:
        return None
    rewards = [
        RewardRecord(
            id=r.id,
            trajectory_id=r.trajectory_id,
            reward=r.reward,
            source=r.source,
            created_at=r.created_at,
            explanation=r.explanation,
        )
        for r in await conn.execute(
            select(R).where(R.c.trajectory_id == trajectory_id).order_by(R.c.id)
        )
    ]
    turns = _turns(await calls_of(conn, trajectory_id))
    return TrajectoryDetail(summary=_summary(row), turns=turns, rewards=rewards)


async def count_calls(conn: AsyncConnection, trajectory_id: str | None = None) -> int:
    stmt = select(func.count()).select_from(C)
    if trajectory_id is not None:
        stmt = stmt.where(C.c.trajectory_id == trajectory_id)
    return int((await conn.execute(stmt)).scalar_one())


async def status_counts(
    conn: AsyncConnection, table: Table, statuses: Sequence[str] | None = None
) -> dict[str, int]:
    """Rows of `table` (trajectories, groups) per status, through its (status, ...) index: only
    the rows of `statuses` are read (all statuses: the whole index)."""
    stmt = select(table.c.status, func.count()).group_by(table.c.status)
    if statuses is not None:
        stmt = stmt.where(table.c.status.in_(statuses))
    return {str(status): int(n) for status, n in await conn.execute(stmt)}


async def count_trajectories(conn: AsyncConnection, status: str | None = None) -> int:
    stmt = select(func.count()).select_from(T)
    if status is not None:
        stmt = stmt.where(T.c.status == status)
    return int((await conn.execute(stmt)).scalar_one())


async def trajectory_of_completion(conn: AsyncConnection, completion_id: str) -> str | None:
    row = (
        await conn.execute(
            select(C.c.trajectory_id).where(C.c.completion_id == completion_id).limit(1)
        )
    ).first()
    return None if row is None else str(row.trajectory_id)


async def call_by_completion_id(conn: AsyncConnection, completion_id: str) -> StoredCall | None:
    """The call that returned this id (the newest, should a retry have recorded it twice)."""
    row = (
        await conn.execute(
            select(C)
            .where(C.c.completion_id == completion_id)
            .order_by(C.c.recorded_at.desc())
            .limit(1)
        )
    ).first()
    return None if row is None else (await read_calls(conn, [row]))[0]


async def trajectory_owner(conn: AsyncConnection, trajectory_id: str) -> tuple[bool, str | None]:
    row = (await conn.execute(select(T.c.owner_key_id).where(T.c.id == trajectory_id))).first()
    return (False, None) if row is None else (True, row.owner_key_id)
