"""The SQL of every write, as jobs the group-commit writer runs inside its transaction.

`record_call` links a call to a trajectory (asking the `Linker` which one) and inserts the call
and its choices; the others close trajectories and add rewards. Each function takes the batch's
`AsyncConnection` and never commits: the writer commits the whole batch. Callers go through
`storage.store.Store`; nothing else should import this module.
"""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy import ColumnElement, Row, func, insert, or_, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.ext.asyncio import AsyncConnection

from storage.linker import Linker
from storage.models import call_choices_table as CC
from storage.models import calls_table as C
from storage.models import rewards_table as R
from storage.models import trajectories_table as T
from storage.records import CallRecord, LinkDecision, LinkKeys, TrajectoryState


def state_from_row(row: Row[Any]) -> TrajectoryState:
    return TrajectoryState(
        id=row.id,
        status=row.status,
        created_at=row.created_at,
        updated_at=row.updated_at,
        turn_count=row.turn_count,
        next_prefix_hash=row.next_prefix_hash,
        last_request_hash=row.last_request_hash,
        last_call_id=row.last_call_id,
        last_call_created_at=row.last_call_created_at,
        last_call_finished_at=row.last_call_finished_at,
    )


_STATE_COLUMNS = [
    T.c.id,
    T.c.status,
    T.c.created_at,
    T.c.updated_at,
    T.c.turn_count,
    T.c.next_prefix_hash,
    T.c.last_request_hash,
    T.c.last_call_id,
    T.c.last_call_created_at,
    T.c.last_call_finished_at,
]


async def _candidates(conn: AsyncConnection, keys: LinkKeys) -> list[TrajectoryState]:
    conds: list[ColumnElement[bool]] = []
    if keys.prefix_hashes:
        conds.append(T.c.next_prefix_hash.in_(list(keys.prefix_hashes)))
    if keys.request_hash is not None:
        conds.append(T.c.last_request_hash == keys.request_hash)
    if not conds:
        return []
    rows = await conn.execute(select(*_STATE_COLUMNS).where(T.c.status == "open", or_(*conds)))
    return [state_from_row(r) for r in rows]


async def _explicit(conn: AsyncConnection, trajectory_id: str | None) -> TrajectoryState | None:
    if trajectory_id is None:
        return None
    row = (await conn.execute(select(*_STATE_COLUMNS).where(T.c.id == trajectory_id))).first()
    return None if row is None else state_from_row(row)


async def _insert_trajectory(
    conn: AsyncConnection, tid: str, record: CallRecord, keys: LinkKeys, now: float
) -> bool:
    """Create trajectory `tid` with this call as turn 0; False if `tid` already exists."""
    values = {
        "id": tid,
        "status": "open",
        "created_at": record.created_at,
        "updated_at": now,
        "group_key": record.explicit_group_key,
        "model": record.model_requested,
        "turn_count": 1,
        "call_count": 1,
        "explicit": record.explicit_trajectory_id is not None,
        "task_signature": keys.task_signature,
        "next_prefix_hash": keys.next_prefix_hash,
        "last_request_hash": keys.request_hash,
        "last_call_id": record.id,
        "last_call_created_at": record.created_at,
        "last_call_finished_at": record.finished_at,
    }
    ins = pg_insert(T) if conn.dialect.name == "postgresql" else sqlite_insert(T)
    result = await conn.execute(ins.values(values).on_conflict_do_nothing(index_elements=["id"]))
    return result.rowcount == 1


async def _advance(
    conn: AsyncConnection,
    decision: LinkDecision,
    record: CallRecord,
    keys: LinkKeys,
    now: float,
) -> int | None:
    """Move trajectory `decision.trajectory_id` onto this call; return the call's turn index.

    "append" takes the next turn; "retry" and "stale" take the turn of `same_turn_as`, and
    "stale" leaves the linking state (hashes, last call) as it is. Returns None when the
    trajectory is gone or (for an implicit match) was closed meanwhile. An explicit id reopens
    a closed trajectory.
    """
    values: dict[str, Any] = {
        "status": "open",
        "closed_at": None,
        "close_reason": None,
        "updated_at": now,
        "call_count": T.c.call_count + 1,
        "group_key": func.coalesce(T.c.group_key, record.explicit_group_key),
    }
    if decision.action != "stale":
        values["last_request_hash"] = keys.request_hash
        values["last_call_id"] = record.id
        values["last_call_created_at"] = record.created_at
        values["last_call_finished_at"] = record.finished_at
        if keys.next_prefix_hash is not None:  # a failed call keeps the old continuation point
            values["next_prefix_hash"] = keys.next_prefix_hash
    if decision.action == "append":
        values["turn_count"] = T.c.turn_count + 1
    stmt = update(T).where(T.c.id == decision.trajectory_id)
    if record.explicit_trajectory_id != decision.trajectory_id:
        stmt = stmt.where(T.c.status == "open")
    row = (await conn.execute(stmt.values(values).returning(T.c.turn_count))).first()
    if row is None:
        return None
    if decision.action == "append":
        return int(row.turn_count) - 1
    same = select(C.c.turn_index).where(C.c.id == decision.same_turn_as)
    prev = (await conn.execute(same)).first()
    return int(prev.turn_index) if prev is not None else int(row.turn_count) - 1


async def record_call(conn: AsyncConnection, record: CallRecord, linker: Linker, now: float) -> str:
    """Link and insert one call; return its trajectory id."""
    keys = linker.keys(record)
    explicit = await _explicit(conn, record.explicit_trajectory_id)
    decision = linker.choose(record, keys, explicit, await _candidates(conn, keys))

    turn_index: int | None = None
    tid = decision.trajectory_id
    if decision.action != "new":
        turn_index = await _advance(conn, decision, record, keys, now)
        if turn_index is None:  # closed or deleted under us: start afresh
            decision = LinkDecision("new", record.explicit_trajectory_id)
            tid = decision.trajectory_id
    if turn_index is None:
        tid = tid or uuid.uuid4().hex
        if await _insert_trajectory(conn, tid, record, keys, now):
            turn_index = 0
        else:  # an explicit id created concurrently (another replica): append to it
            decision = LinkDecision("append", tid)
            turn_index = await _advance(conn, decision, record, keys, now)
            if turn_index is None:
                raise RuntimeError(f"trajectory {tid!r} exists but could not be appended to")
    assert tid is not None
    retry_of = decision.same_turn_as if decision.action == "retry" else None
    superseded_by = decision.same_turn_as if decision.action == "stale" else None

    prompt_tokens, completion_tokens = record.token_counts()
    await conn.execute(
        insert(C).values(
            id=record.id,
            request_id=record.request_id,
            created_at=record.created_at,
            finished_at=record.finished_at,
            recorded_at=now,
            model_requested=record.model_requested,
            adapter_version=record.adapter_version,
            engine=record.engine,
            request_messages=record.request_messages,
            tools=record.tools,
            params=record.params,
            response=record.response,
            prompt_token_ids=record.prompt_token_ids,
            usage=record.usage,
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            latency_s=record.latency_s,
            status=record.status,
            error=record.error,
            api_key_id=record.api_key_id,
            stream=record.stream,
            token_ids_note=record.token_ids_note,
            explicit_trajectory_id=record.explicit_trajectory_id,
            explicit_group_key=record.explicit_group_key,
            retry_count=record.retry_count,
            request_hash=keys.request_hash,
            trajectory_id=tid,
            turn_index=turn_index,
            retry_of=retry_of,
            superseded_by=superseded_by,
        )
    )
    if record.choices:
        await conn.execute(
            insert(CC),
            [
                {
                    "call_id": record.id,
                    "choice_index": c.index,
                    "message": c.message,
                    "finish_reason": c.finish_reason,
                    "completion_token_ids": c.completion_token_ids,
                    "completion_logprobs": c.completion_logprobs,
                }
                for c in record.choices
            ],
        )
    if retry_of is not None:
        await conn.execute(update(C).where(C.c.id == retry_of).values(superseded_by=record.id))
    return tid


async def close_trajectory(
    conn: AsyncConnection, trajectory_id: str, reason: str, now: float
) -> bool | None:
    """Close an open trajectory. True if closed now, False if already closed, None if missing."""
    result = await conn.execute(
        update(T)
        .where(T.c.id == trajectory_id, T.c.status == "open")
        .values(status="closed", closed_at=now, close_reason=reason)
    )
    if result.rowcount == 1:
        return True
    exists = (await conn.execute(select(T.c.id).where(T.c.id == trajectory_id))).first()
    return False if exists is not None else None


async def add_reward(
    conn: AsyncConnection,
    trajectory_id: str,
    reward: float,
    source: str,
    explanation: str | None,
    now: float,
) -> int | None:
    """Store a reward and close the trajectory; return the reward id, None if no trajectory."""
    if await close_trajectory(conn, trajectory_id, "reward", now) is None:
        return None
    result = await conn.execute(
        insert(R)
        .values(
            trajectory_id=trajectory_id,
            reward=reward,
            source=source,
            created_at=now,
            explanation=explanation,
        )
        .returning(R.c.id)
    )
    return int(result.scalar_one())


async def close_idle(conn: AsyncConnection, cutoff: float, now: float) -> list[str]:
    """Close every open trajectory not updated since `cutoff`; return their ids."""
    result = await conn.execute(
        update(T)
        .where(T.c.status == "open", T.c.updated_at < cutoff)
        .values(status="closed", closed_at=now, close_reason="idle")
        .returning(T.c.id)
    )
    return sorted(r.id for r in result)
