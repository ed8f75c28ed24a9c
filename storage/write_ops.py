"""The SQL of every write, as handlers the group-commit writer runs inside its transaction.

`record_calls` links a whole batch of calls to trajectories and inserts them in a fixed number
of statements, whatever the batch size: it loads every trajectory the batch could touch (locking
the rows on Postgres), lets the linking rule (`storage.linking`) decide call by call against an
in-memory view that already includes the earlier calls of the batch, then writes the prompt
chunks not stored yet (`storage.prompt_chunks`: a call row keeps only their hashes), new
trajectories, changed trajectories, calls, choices and supersede marks with one executemany
each. The other handlers close trajectories and add rewards. Handlers never commit: the writer
commits the batch.
Callers go through `storage.store.Store`; nothing else should import this module.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import asdict, fields, replace
from typing import Any

from sqlalchemy import bindparam, insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from storage.group_ops import shadow_group_rows
from storage.linking import PrefixLinker
from storage.models import call_choices_table as CC
from storage.models import call_samples_table as CS
from storage.models import calls_table as C
from storage.models import group_members_table as GM
from storage.models import groups_table as G
from storage.models import rewards_table as R
from storage.models import trajectories_table as T
from storage.prompt_chunks import SplitPrompts, insert_missing
from storage.records import CallRecord, LinkKeys
from storage.trajectory_view import (
    TRAJECTORY_FIELDS,
    LinkStats,
    Trajectory,
    TrajectoryView,
    load_view,
)

log = logging.getLogger(__name__)

# No columns of their own: choices and samples have tables, the prompt is stored by content
# (storage.prompt_chunks), the owner is the trajectory's, time to first token is telemetry's.
_SKIP = frozenset(
    {
        "choices",
        "shadow_samples",
        "time_to_first_token_s",
        "request_messages",
        "tools",
        "prompt_token_ids",
        "owner_key_id",
        "session_lane",  # the trajectory keeps it, hashed with the owner (storage.linking)
        "parent_lane",
        "held_out",  # the trajectory keeps it (storage.held_out)
    }
)


async def _turn_of(conn: AsyncConnection, call_id: str, pending: dict[str, dict[str, Any]]) -> int:
    if call_id in pending:
        return int(pending[call_id]["turn_index"])
    row = (await conn.execute(select(C.c.turn_index).where(C.c.id == call_id))).first()
    if row is None:
        raise RuntimeError(f"linker named unknown call {call_id!r} as the same turn")
    return int(row.turn_index)


def _call_row(
    record: CallRecord, keys: LinkKeys, tid: str, turn: int, now: float, prompts: SplitPrompts
) -> dict[str, Any]:
    prompt_tokens, completion_tokens = record.token_counts()
    row = {f.name: getattr(record, f.name) for f in fields(CallRecord) if f.name not in _SKIP}
    row.update(
        message_refs=prompts.messages(record.owner_key_id, record.request_messages),
        tool_refs=prompts.tools(record.owner_key_id, record.tools),
        token_refs=prompts.token_ids(record.owner_key_id, record.prompt_token_ids),
        recorded_at=now,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        request_hash=keys.request_hash,
        trajectory_id=tid,
        turn_index=turn,
        retry_of=None,
        superseded_by=None,
    )
    return row


async def record_calls(
    conn: AsyncConnection,
    records: list[CallRecord],
    linker: PrefixLinker,
    now: float,
    stats: LinkStats | None = None,
) -> list[str]:
    """Link and insert a batch of calls, in order; return each call's trajectory id."""
    keys = [linker.keys(r) for r in records]
    view = await load_view(conn, records, keys, retry_window_s=linker.retry_window_s)
    if stats is not None:
        stats.calls += len(records)
        stats.rows += len(view.by_id)
    pending: dict[str, dict[str, Any]] = {}  # call id -> calls row, in batch order
    prompts = SplitPrompts()  # the batch's prompt chunks
    supersede: list[dict[str, str]] = []  # earlier calls (already stored) retried now
    tids: list[str] = []

    for record, k in zip(records, keys, strict=True):
        explicit_id = record.explicit_trajectory_id
        explicit = view.by_id.get(explicit_id) if explicit_id else None
        if explicit is not None and explicit.owner_key_id != record.owner_key_id:
            # Another key's trajectory: never continued by this one (the HTTP edge refuses such a
            # call with a 403 first; this holds if one slips past it). It starts its own.
            log.warning(
                "call %s named trajectory %s of another API key; it starts its own instead",
                record.id,
                explicit_id,
            )
            record = replace(record, explicit_trajectory_id=None)
            explicit_id, explicit = None, None
        decision = linker.choose(
            record, k, explicit.state() if explicit else None, view.candidates(k), view.lanes(k)
        )
        # The rule only ever names a trajectory the view holds: the explicit one, or an open
        # candidate (closed trajectories are never continued implicitly).
        if decision.action == "new":
            t = Trajectory(
                id=decision.trajectory_id or uuid.uuid4().hex,
                status="open",
                created_at=record.created_at,
                updated_at=now,
                closed_at=None,
                close_reason=None,
                group_key=record.explicit_group_key,
                model=record.model_requested,
                turn_count=1,
                call_count=1,
                explicit=explicit_id is not None,
                task_signature=k.task_signature,
                next_prefix_hash=k.next_prefix_hash,
                last_request_hash=k.request_hash,
                last_call_id=record.id,
                last_call_created_at=record.created_at,
                last_call_finished_at=record.finished_at,
                last_call_status=record.status,
                owner_key_id=record.owner_key_id,
                next_tool_call_hash=k.next_tool_call_hash,
                session_lane=k.session_lane,
                agent_signature=k.agent_signature,
                parent_trajectory_id=decision.parent_trajectory_id,
                held_out=record.held_out,
            )
            view.add(t)
            turn = 0
        else:
            t = view.by_id[decision.trajectory_id or ""]
            changes: dict[str, Any] = {
                "status": "open",
                "closed_at": None,
                "close_reason": None,
                "updated_at": now,
                "call_count": t.call_count + 1,
                "group_key": t.group_key or record.explicit_group_key,
            }
            if record.held_out and not t.held_out:
                # A call marked held out (an evaluation run) that joins a trajectory: the whole
                # trajectory is held out from now on, so the marked call never trains.
                changes["held_out"] = True
            if decision.action == "append":
                turn = t.turn_count
                changes["turn_count"] = t.turn_count + 1
            else:
                assert decision.same_turn_as is not None
                turn = await _turn_of(conn, decision.same_turn_as, pending)
            if decision.action != "stale":  # a late earlier attempt leaves linking state alone
                changes.update(
                    last_request_hash=k.request_hash,
                    last_call_id=record.id,
                    last_call_created_at=record.created_at,
                    last_call_finished_at=record.finished_at,
                    last_call_status=record.status,
                )
                if k.next_prefix_hash is not None:  # a failed call keeps the continuation point
                    changes["next_prefix_hash"] = k.next_prefix_hash
                    changes["next_tool_call_hash"] = k.next_tool_call_hash
                if k.session_lane is not None and t.session_lane is None:
                    # A trajectory stored before lanes takes its lane at its next call; one that
                    # has a lane keeps it and the agent that opened it: Codex's summarising
                    # call comes without tools, and the session after it is the same agent's.
                    changes["session_lane"] = k.session_lane
                    changes["agent_signature"] = k.agent_signature
            view.change(t, **changes)

        row = _call_row(record, k, t.id, turn, now, prompts)
        row["history_rewritten"] = decision.history_rewritten
        if decision.action == "retry" and decision.same_turn_as is not None:
            row["retry_of"] = decision.same_turn_as
            if decision.same_turn_as in pending:
                pending[decision.same_turn_as]["superseded_by"] = record.id
            else:
                supersede.append({"_id": decision.same_turn_as, "superseded_by": record.id})
        elif decision.action == "stale":
            row["superseded_by"] = decision.same_turn_as
        pending[record.id] = row
        tids.append(t.id)

    await insert_missing(conn, prompts)
    await _write(conn, view, records, pending, supersede)
    held_out = {tid for tid in tids if view.by_id[tid].held_out}
    await _write_shadow_samples(conn, records, tids, now, held_out)
    return tids


async def _write_shadow_samples(
    conn: AsyncConnection,
    records: list[CallRecord],
    tids: list[str],
    now: float,
    held_out: set[str],
) -> None:
    """Store shadow samples; a completed call with samples also forms a ready "shadow" group,
    unless its trajectory is held out of training (`storage.held_out`): no group holds one."""
    samples, groups, members = [], [], []
    for record, tid in zip(records, tids, strict=True):
        if not record.shadow_samples:
            continue
        samples += [
            {
                "call_id": record.id,
                "sample_index": c.index,
                "message": c.message,
                "finish_reason": c.finish_reason,
                "completion_token_ids": c.completion_token_ids,
                "completion_logprobs": c.completion_logprobs,
            }
            for c in record.shadow_samples
        ]
        if record.status == "completed" and record.choices and tid not in held_out:
            group, rows = shadow_group_rows(record, tid, now)
            groups.append(group)
            members += rows
    if samples:
        await conn.execute(insert(CS), samples)
    if groups:
        await conn.execute(insert(G), groups)
        await conn.execute(insert(GM), members)


async def _write(
    conn: AsyncConnection,
    view: TrajectoryView,
    records: list[CallRecord],
    pending: dict[str, dict[str, Any]],
    supersede: list[dict[str, str]],
) -> None:
    if view.new:
        await conn.execute(insert(T), [asdict(view.by_id[i]) for i in sorted(view.new)])
    if view.dirty:
        cols = [n for n in TRAJECTORY_FIELDS if n != "id"]
        stmt = update(T).where(T.c.id == bindparam("_id")).values({n: bindparam(n) for n in cols})
        params = []
        for i in sorted(view.dirty):
            values = asdict(view.by_id[i])
            values["_id"] = values.pop("id")
            params.append(values)
        await conn.execute(stmt, params)
    await conn.execute(insert(C), list(pending.values()))
    choices = [
        {
            "call_id": r.id,
            "choice_index": c.index,
            "message": c.message,
            "finish_reason": c.finish_reason,
            "completion_token_ids": c.completion_token_ids,
            "completion_logprobs": c.completion_logprobs,
        }
        for r in records
        for c in r.choices
    ]
    if choices:
        await conn.execute(insert(CC), choices)
    if supersede:
        stmt = (
            update(C)
            .where(C.c.id == bindparam("_id"))
            .values(superseded_by=bindparam("superseded_by"))
        )
        await conn.execute(stmt, supersede)


async def forget_response(conn: AsyncConnection, completion_id: str) -> bool:
    """`DELETE /v1/responses/{id}`: the response can no longer be read back or continued; its
    call stays (a trajectory keeps its turns). False when no retrievable response has the id."""
    result = await conn.execute(
        update(C)
        .where(C.c.completion_id == completion_id, C.c.retrievable.is_(True))
        .values(retrievable=False)
    )
    return bool(result.rowcount)


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
