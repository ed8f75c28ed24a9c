"""The SQL of group reads: pages of groups, and one group with everything its members need.

A member view carries the member's conversation (for the judge), its turns' exact token ids and
stored logprobs (for training), its judge score and the environment's explicit reward, side by
side: which of them trains is the reward policy's choice (`trainer.scoring.rewards`). Callers
go through `storage.store.Store`; nothing else should import this module.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Row, and_, or_, select
from sqlalchemy.ext.asyncio import AsyncConnection

from storage import read_ops
from storage.models import call_choices_table as CC
from storage.models import call_samples_table as CS
from storage.models import calls_table as C
from storage.models import group_members_table as GM
from storage.models import groups_table as G
from storage.models import rewards_table as R
from storage.models import scores_table as S
from storage.read_ops import decode_cursor, encode_cursor
from storage.records import (
    LOGPROBS_AFTER_GRAMMAR,
    GroupDetail,
    GroupMemberView,
    GroupPage,
    GroupSummary,
    ScoreRecord,
    TrainingTurn,
)


def _summary(row: Row[Any]) -> GroupSummary:
    return GroupSummary(
        id=row.id,
        source=row.source,
        key=row.key,
        status=row.status,
        created_at=row.created_at,
        updated_at=row.updated_at,
        ready_at=row.ready_at,
        scored_at=row.scored_at,
        member_count=row.member_count,
        judge_model=row.judge_model,
        rubric_hash=row.rubric_hash,
        judge_latency_s=row.judge_latency_s,
        judge_attempts=row.judge_attempts,
        judge_prompt_tokens=row.judge_prompt_tokens,
        judge_completion_tokens=row.judge_completion_tokens,
        judge_cost_usd=row.judge_cost_usd,
        failure=row.failure,
        trained_step=row.trained_step,
        owner_key_id=row.owner_key_id,
        hold_reason=row.hold_reason,
    )


async def list_groups(
    conn: AsyncConnection,
    *,
    status: str | None,
    source: str | None,
    untrained: bool,
    limit: int,
    cursor: str | None,
    oldest_first: bool = False,
    owner: str | None = None,
) -> GroupPage:
    if limit < 1:
        raise ValueError("limit must be at least 1")
    stmt = select(G)
    if status is not None:
        stmt = stmt.where(G.c.status == status)
    if source is not None:
        stmt = stmt.where(G.c.source == source)
    if untrained:
        stmt = stmt.where(G.c.trained_step.is_(None))
    if owner is not None:
        stmt = stmt.where(G.c.owner_key_id == owner)
    if cursor is not None:
        c_at, c_id = decode_cursor(cursor)
        if oldest_first:
            after = or_(G.c.created_at > c_at, and_(G.c.created_at == c_at, G.c.id > c_id))
        else:
            after = or_(G.c.created_at < c_at, and_(G.c.created_at == c_at, G.c.id < c_id))
        stmt = stmt.where(after)
    if oldest_first:
        stmt = stmt.order_by(G.c.created_at, G.c.id)
    else:
        stmt = stmt.order_by(G.c.created_at.desc(), G.c.id.desc())
    rows = (await conn.execute(stmt.limit(limit + 1))).all()
    items = [_summary(r) for r in rows[:limit]]
    next_cursor = None
    if len(rows) > limit:
        next_cursor = encode_cursor(items[-1].created_at, items[-1].id)
    return GroupPage(items=items, next_cursor=next_cursor)


async def get_group(conn: AsyncConnection, group_id: str) -> GroupDetail | None:
    row = (await conn.execute(select(G).where(G.c.id == group_id))).first()
    if row is None:
        return None
    members = (
        await conn.execute(select(GM).where(GM.c.group_id == group_id).order_by(GM.c.position))
    ).all()
    scores: dict[str, ScoreRecord] = {}
    for s in await conn.execute(select(S).where(S.c.group_id == group_id).order_by(S.c.id)):
        scores[s.member_id] = ScoreRecord(
            member_id=s.member_id,
            score=s.score,
            explanation=s.explanation,
            judge_model=s.judge_model,
            rubric_hash=s.rubric_hash,
            latency_s=s.latency_s,
            prompt_tokens=s.prompt_tokens,
            completion_tokens=s.completion_tokens,
            cost_usd=s.cost_usd,
            created_at=s.created_at,
        )
    trajectory_ids = sorted({m.trajectory_id for m in members if m.call_id is None})
    explicit: dict[str, float] = {}
    if trajectory_ids:
        for r in await conn.execute(
            select(R.c.trajectory_id, R.c.reward)
            .where(R.c.trajectory_id.in_(trajectory_ids))
            .order_by(R.c.id)
        ):
            explicit[r.trajectory_id] = r.reward
    views = []
    for m in members:
        if m.call_id is None:
            messages, tools, turns = await _trajectory_member(conn, m.trajectory_id)
        else:
            messages, tools, turns = await _sample_member(conn, m)
        ruler = scores.get(m.member_id)
        ex = explicit.get(m.trajectory_id) if m.call_id is None else None
        views.append(
            GroupMemberView(
                member_id=m.member_id,
                position=m.position,
                trajectory_id=m.trajectory_id,
                call_id=m.call_id,
                choice_index=m.choice_index,
                sample_index=m.sample_index,
                returned=m.sample_index is None,
                messages=messages,
                tools=tools,
                ruler=ruler,
                explicit_reward=ex,
                turns=turns,
            )
        )
    return GroupDetail(summary=_summary(row), members=views)


async def _trajectory_member(
    conn: AsyncConnection, trajectory_id: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, list[TrainingTurn]]:
    """The trajectory's conversation and, per turn, the standing call's exact token ids."""
    standing = read_ops.standing_calls(await read_ops.calls_of(conn, trajectory_id))
    turns = []
    for call in standing:
        rec = call.record
        answer = rec.choices[0] if rec.choices else None
        turns.append(
            TrainingTurn(
                call_id=rec.id,
                prompt_token_ids=rec.prompt_token_ids,
                completion_token_ids=answer.completion_token_ids if answer else None,
                completion_logprobs=answer.completion_logprobs if answer else None,
                adapter_version=rec.adapter_version,
                logprobs_after_grammar=bool(rec.params.get(LOGPROBS_AFTER_GRAMMAR)),
            )
        )
    if not standing:
        return [], None, turns
    last = standing[-1].record
    messages = list(last.request_messages)
    if last.choices:
        messages.append({"role": "assistant", **last.choices[0].message})
    return messages, last.tools, turns


async def _sample_member(
    conn: AsyncConnection, m: Row[Any]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, list[TrainingTurn]]:
    row = (await conn.execute(select(C).where(C.c.id == m.call_id))).first()
    if row is None:
        return [], None, []
    call = (await read_ops.read_calls(conn, [row]))[0].record
    if m.sample_index is None:
        table, where = CC, and_(CC.c.call_id == m.call_id, CC.c.choice_index == m.choice_index)
    else:
        table, where = CS, and_(CS.c.call_id == m.call_id, CS.c.sample_index == m.sample_index)
    answer = (await conn.execute(select(table).where(where))).first()
    messages = list(call.request_messages)
    if answer is not None:
        messages.append({"role": "assistant", **answer.message})
    turn = TrainingTurn(
        call_id=call.id,
        prompt_token_ids=call.prompt_token_ids,
        completion_token_ids=answer.completion_token_ids if answer is not None else None,
        completion_logprobs=answer.completion_logprobs if answer is not None else None,
        adapter_version=call.adapter_version,
        logprobs_after_grammar=bool((call.params or {}).get(LOGPROBS_AFTER_GRAMMAR)),
    )
    return messages, call.tools, [turn]


async def group_ids_of_trajectory(conn: AsyncConnection, trajectory_id: str) -> list[str]:
    rows = await conn.execute(
        select(GM.c.group_id).where(GM.c.trajectory_id == trajectory_id).distinct()
    )
    return sorted(r.group_id for r in rows)
