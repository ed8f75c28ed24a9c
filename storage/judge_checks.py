"""The SQL of judge checks: one row per judging, groups held by the gate, and their release.

A check row (`JudgeCheckRecord`) is written in the same transaction as the group's scores, so a
group is never visible as "scored" with its gate decision still to come: when the gate holds the
scores, the group goes straight to "held" (with `hold_reason`), a status the trainer's read of
scored groups never selects. What the checks mean and how the gate decides is
`trainer.scoring.judge_checks`; this module only stores and reads. Reads are bounded: the newest
N rows of one judge and rubric (index `ix_judge_checks_judge`) and of each kind of check
(`ix_judge_checks_canaries`, `ix_judge_checks_positions`), of one owner
(`ix_judge_checks_owner`) or of the table (primary key). Callers go through `storage.store.Store`.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from sqlalchemy import Row, and_, func, insert, select, update
from sqlalchemy.ext.asyncio import AsyncConnection

from storage import group_ops
from storage.models import groups_table as G
from storage.models import judge_checks_table as J
from storage.records import JudgeCheckRecord, JudgeOutcome


async def finish_scoring(
    conn: AsyncConnection, group_id: str, owner: str, outcome: JudgeOutcome, now: float
) -> bool:
    """`group_ops.finish_scoring`, then (in the same transaction) the check row and the hold.

    A group scored again after a hold loses its old `hold_reason` unless held again."""
    if not await group_ops.finish_scoring(conn, group_id, owner, outcome, now):
        return False
    held = outcome.status == "scored" and outcome.hold_reason is not None
    await conn.execute(
        update(G)
        .where(G.c.id == group_id)
        .values(status="held" if held else outcome.status, hold_reason=outcome.hold_reason)
    )
    if outcome.check is not None:
        owner_key = (
            await conn.execute(select(G.c.owner_key_id).where(G.c.id == group_id))
        ).scalar_one_or_none()
        row = asdict(outcome.check)
        row.update(created_at=now, owner_key_id=owner_key, group_id=group_id)
        await conn.execute(insert(J).values(**row))
    return True


def _record(row: Row[Any]) -> JudgeCheckRecord:
    return JudgeCheckRecord(
        group_id=row.group_id,
        judge_model=row.judge_model,
        rubric_hash=row.rubric_hash,
        member_count=row.member_count,
        created_at=row.created_at,
        owner_key_id=row.owner_key_id,
        canary_kind=row.canary_kind,
        canary_member_id=row.canary_member_id,
        canary_score=row.canary_score,
        canary_median=row.canary_median,
        canary_passed=row.canary_passed,
        position_tau=row.position_tau,
        env_members=row.env_members,
        env_spearman=row.env_spearman,
        env_kendall=row.env_kendall,
        mean_reward=row.mean_reward,
        completion_tokens_mean=row.completion_tokens_mean,
        completion_tokens_std=row.completion_tokens_std,
        decision=row.decision,
        reason=row.reason,
    )


async def checks_of_judge(
    conn: AsyncConnection, judge_model: str, rubric_hash: str, limit: int
) -> list[JudgeCheckRecord]:
    """One judge model and rubric's checks, newest first: its newest `limit` rows, and with them
    the newest `limit` canary checks and the newest `limit` re-orderings however far back they
    lie (each kind is drawn for a share of groups and is read over its own window). Three
    bounded reads, each on its own index; at most 3 x `limit` rows."""
    of_judge = and_(J.c.judge_model == judge_model, J.c.rubric_hash == rubric_hash)
    found: dict[int, Row[Any]] = {}
    for kind in (None, J.c.canary_passed.is_not(None), J.c.position_tau.is_not(None)):
        where = of_judge if kind is None else and_(of_judge, kind)
        rows = await conn.execute(select(J).where(where).order_by(J.c.id.desc()).limit(limit))
        found.update((r.id, r) for r in rows)
    return [_record(found[i]) for i in sorted(found, reverse=True)]


async def newest_checks(
    conn: AsyncConnection, limit: int, owner: str | None = None
) -> list[JudgeCheckRecord]:
    """The newest `limit` checks of any judge (only `owner`'s groups when given), newest first."""
    stmt = select(J)
    if owner is not None:
        stmt = stmt.where(J.c.owner_key_id == owner)
    rows = await conn.execute(stmt.order_by(J.c.id.desc()).limit(limit))
    return [_record(r) for r in rows]


async def held_count(
    conn: AsyncConnection,
    owner: str | None = None,
    judge_model: str | None = None,
    rubric_hash: str | None = None,
) -> int:
    """Groups whose scores are held (an index range over status "held": grows with what is held,
    not with history)."""
    stmt = select(func.count()).select_from(G).where(G.c.status == "held")
    if owner is not None:
        stmt = stmt.where(G.c.owner_key_id == owner)
    if judge_model is not None:
        stmt = stmt.where(G.c.judge_model == judge_model)
    if rubric_hash is not None:
        stmt = stmt.where(G.c.rubric_hash == rubric_hash)
    return int((await conn.execute(stmt)).scalar_one())


async def requeue_held(
    conn: AsyncConnection, judge_model: str, rubric_hash: str, limit: int, now: float
) -> list[str]:
    """Put up to `limit` groups held from this judge and rubric back to "ready" (oldest first),
    to be judged again; their held scores stay stored and are never trained on."""
    ids = [
        r.id
        for r in await conn.execute(
            select(G.c.id)
            .where(
                G.c.status == "held", G.c.judge_model == judge_model, G.c.rubric_hash == rubric_hash
            )
            .order_by(G.c.created_at, G.c.id)
            .limit(limit)
        )
    ]
    if ids:
        await conn.execute(
            update(G)
            .where(and_(G.c.id.in_(ids), G.c.status == "held"))
            .values(status="ready", ready_at=now, updated_at=now, hold_reason=None)
        )
    return ids
