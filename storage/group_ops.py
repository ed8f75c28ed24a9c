"""The SQL of group writes: forming groups, claiming them for the judge, storing scores.

These functions run inside the group-commit writer's transaction (they never commit); the reads
are in `storage.group_reads`. Which group a trajectory joins and when a group is ready is
decided by the rule in `storage.grouping`. Shadow groups
are written by `shadow_group_rows`, called from `storage.write_ops` in the same transaction as
their call. Callers go through `storage.store.Store`; nothing else should import this module.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import and_, delete, exists, insert, or_, select, text, update
from sqlalchemy.ext.asyncio import AsyncConnection

from storage.grouping import SignatureGrouper
from storage.models import calls_table as C
from storage.models import group_members_table as GM
from storage.models import groups_table as G
from storage.models import rewards_table as R
from storage.models import scores_table as S
from storage.models import trajectories_table as T
from storage.prompt_chunks import load_prompts
from storage.records import (
    CallRecord,
    GroupCandidate,
    GroupKey,
    GroupState,
    JudgeOutcome,
)

_CANDIDATE_BATCH = 500
_FORMING_LOCK = 0x726C70726F7879  # "rlproxy": Postgres advisory lock key of group formation
CLAIMABLE = ("ready", "failed", "scored", "forming", "held")
DEFAULT_LEASE_S = 60.0
"""How long a claim holds without renewal: the scorer renews it every third of this while the
judge works, so it only runs out when the scorer's process is gone (or cannot write)."""


@dataclass(frozen=True)
class Claim:
    """Who claims a group for scoring (a store's `instance_id`) and for how long."""

    owner: str
    lease_s: float


@dataclass
class FormResult:
    """What one pass of `form_groups` did."""

    assigned: int = 0
    """Trajectories added to a group."""
    ready: list[str] = field(default_factory=list)
    """Groups that became ready."""
    moved: int = 0
    """Members moved out of a group that would not fill (to a fallback such as a cohort)."""


# --- writes -------------------------------------------------------------------------------


def shadow_group_rows(
    record: CallRecord, trajectory_id: str, now: float
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The group row and member rows for a call with shadow samples.

    Members are ordered by the row each sample had in the batched generation, so the position of
    the returned answer among them is as random as the choice of which one to return.
    """
    group_id = uuid.uuid4().hex
    k = 1 + len(record.shadow_samples)
    sampled = {s.index for s in record.shadow_samples}
    returned_row = min(set(range(k)) - sampled, default=0)
    entries: list[tuple[int, dict[str, Any]]] = [
        (
            returned_row,
            {"member_id": f"{record.id}:c0", "choice_index": 0, "sample_index": None},
        )
    ]
    for s in record.shadow_samples:
        entries.append(
            (
                s.index,
                {
                    "member_id": f"{record.id}:s{s.index}",
                    "choice_index": None,
                    "sample_index": s.index,
                },
            )
        )
    entries.sort(key=lambda e: e[0])
    members = [
        {
            "group_id": group_id,
            "position": position,
            "trajectory_id": trajectory_id,
            "call_id": record.id,
            "added_at": now,
            **entry,
        }
        for position, (_, entry) in enumerate(entries)
    ]
    group = _group_row(group_id, GroupKey("shadow", record.id, record.owner_key_id), now)
    group.update(status="ready", ready_at=now, member_count=len(members))
    return group, members


def _group_row(group_id: str, gk: GroupKey, now: float) -> dict[str, Any]:
    return {
        "id": group_id,
        "source": gk.source,
        "key": gk.key,
        "status": "forming",
        "created_at": now,
        "updated_at": now,
        "ready_at": None,
        "scored_at": None,
        "member_count": 0,
        "rubric_hash": None,
        "judge_model": None,
        "judge_latency_s": None,
        "judge_attempts": None,
        "judge_prompt_tokens": None,
        "judge_completion_tokens": None,
        "judge_cost_usd": None,
        "failure": None,
        "trained_step": None,
        "trained_at": None,
        "owner_key_id": gk.owner,
    }


async def _candidates(conn: AsyncConnection, trajectory_ids: list[str]) -> list[GroupCandidate]:
    if not trajectory_ids:
        return []
    rows = (await conn.execute(select(T).where(T.c.id.in_(trajectory_ids)))).all()
    first: dict[str, Any] = {}
    calls = await conn.execute(
        select(C.c.id, C.c.trajectory_id, C.c.message_refs, C.c.tool_refs)
        .where(C.c.trajectory_id.in_(trajectory_ids), C.c.turn_index == 0)
        .order_by(C.c.recorded_at)
    )
    for c in calls:
        first.setdefault(c.trajectory_id, c)
    prompts = await load_prompts(conn, list(first.values()), token_ids=False)
    out = []
    for r in rows:
        call = first.get(r.id)
        out.append(
            GroupCandidate(
                trajectory_id=r.id,
                closed_at=r.closed_at if r.closed_at is not None else r.updated_at,
                group_key=r.group_key,
                task_signature=r.task_signature,
                first_messages=prompts[call.id].messages if call is not None else [],
                tools=prompts[call.id].tools if call is not None else None,
                owner_key_id=r.owner_key_id,
            )
        )
    return sorted(out, key=lambda c: (c.closed_at, c.trajectory_id))


class _Forming:
    """The forming parts touched by one pass, so a batch fills parts in memory."""

    def __init__(self, conn: AsyncConnection, max_size: int, now: float) -> None:
        self.conn = conn
        self.max_size = max_size
        self.now = now
        self.open: dict[GroupKey, dict[str, Any]] = {}

    async def add(self, gk: GroupKey, trajectory_id: str) -> None:
        group = self.open.get(gk)
        if group is None or group["member_count"] >= self.max_size:
            group = await self._find(gk)
        await self.conn.execute(
            insert(GM).values(
                group_id=group["id"],
                member_id=trajectory_id,
                position=group["member_count"],
                trajectory_id=trajectory_id,
                call_id=None,
                choice_index=None,
                sample_index=None,
                added_at=self.now,
            )
        )
        group["member_count"] += 1
        await self.conn.execute(
            update(G)
            .where(G.c.id == group["id"])
            .values(member_count=group["member_count"], updated_at=self.now)
        )
        self.open[gk] = group

    async def _find(self, gk: GroupKey) -> dict[str, Any]:
        row = (
            await self.conn.execute(
                select(G.c.id, G.c.member_count)
                .where(
                    G.c.source == gk.source,
                    G.c.key == gk.key,
                    G.c.owner_key_id.is_(None)
                    if gk.owner is None
                    else G.c.owner_key_id == gk.owner,
                    G.c.status == "forming",
                    G.c.member_count < self.max_size,
                )
                .order_by(G.c.created_at)
                .limit(1)
            )
        ).first()
        if row is not None:
            return {"id": row.id, "member_count": row.member_count}
        group = _group_row(uuid.uuid4().hex, gk, self.now)
        await self.conn.execute(insert(G).values(**group))
        return {"id": group["id"], "member_count": 0}


async def form_groups(conn: AsyncConnection, grouper: SignatureGrouper, now: float) -> FormResult:
    """Put closed, ungrouped trajectories into groups; mark forming groups ready. A trajectory
    held out of training (`storage.held_out`) is never a candidate: no group holds one.

    On Postgres several replicas may run this at once; a transaction-scoped advisory lock makes
    them take turns, so the next one reads the memberships the last one committed (under READ
    COMMITTED both would otherwise read the same trajectories as ungrouped and each put them in
    a group of its own). SQLite has one writer at a time already."""
    if conn.dialect.name == "postgresql":
        await conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _FORMING_LOCK})
    result = FormResult()
    forming = _Forming(conn, grouper.max_size, now)
    in_trajectory_group = exists().where(GM.c.trajectory_id == T.c.id, GM.c.call_id.is_(None))
    ids = [
        r.id
        for r in await conn.execute(
            select(T.c.id)
            .where(T.c.status == "closed", T.c.held_out.is_(False), ~in_trajectory_group)
            .order_by(T.c.closed_at, T.c.id)
            .limit(_CANDIDATE_BATCH)
        )
    ]
    for candidate in await _candidates(conn, ids):
        gk = grouper.assign(candidate)
        if gk is not None:
            await forming.add(gk, candidate.trajectory_id)
            result.assigned += 1

    groups = (await conn.execute(select(G).where(G.c.status == "forming"))).all()
    for g in groups:
        state = GroupState(g.id, g.source, g.key, g.created_at, g.member_count)
        if g.member_count and grouper.is_ready(state, now):
            await conn.execute(
                update(G).where(G.c.id == g.id).values(status="ready", ready_at=now, updated_at=now)
            )
            result.ready.append(g.id)
            continue
        members = [
            r.trajectory_id
            for r in await conn.execute(select(GM.c.trajectory_id).where(GM.c.group_id == g.id))
        ]
        here = GroupKey(g.source, g.key)
        moves = [
            (c, gk)
            for c in await _candidates(conn, members)
            if (gk := grouper.fallback(state, c, now)) is not None and gk != here
        ]
        if moves and len(moves) == len(members):
            await conn.execute(delete(GM).where(GM.c.group_id == g.id))
            await conn.execute(
                update(G)
                .where(G.c.id == g.id)
                .values(status="expired", member_count=0, updated_at=now)
            )
            for c, gk in moves:
                await forming.add(gk, c.trajectory_id)
                result.moved += 1
    return result


async def settle_explicit_groups(conn: AsyncConnection, limit: int, now: float) -> list[str]:
    """Ready groups whose every member is a trajectory the environment rewarded: "scored" from
    those rewards with no judge call, as the scorer stores them (`judge_model` "explicit", no
    scores of its own; `Store.get_group` picks the explicit rewards). Oldest first, at most
    `limit`; their ids. Shadow members (one answer at a turn) carry no reward of their own, so a
    group that holds one is never settled here."""
    rewarded = exists().where(R.c.trajectory_id == GM.c.trajectory_id)
    needs_judge = exists().where(GM.c.group_id == G.c.id, or_(GM.c.call_id.is_not(None), ~rewarded))
    ids = [
        r.id
        for r in await conn.execute(
            select(G.c.id)
            .where(G.c.status == "ready", G.c.member_count >= 2, ~needs_judge)
            .order_by(G.c.ready_at, G.c.id)
            .limit(limit)
        )
    ]
    if ids:
        await conn.execute(
            update(G)
            .where(G.c.id.in_(ids), G.c.status == "ready")
            .values(
                status="scored",
                scored_at=now,
                updated_at=now,
                judge_model="explicit",
                rubric_hash=None,
                judge_latency_s=None,
                judge_attempts=None,
                judge_prompt_tokens=None,
                judge_completion_tokens=None,
                judge_cost_usd=None,
                failure=None,
                hold_reason=None,
            )
        )
    return ids


def _lease_expired(now: float) -> Any:
    """A "scoring" group whose scorer is gone: its lease ran out (or, claimed before leases
    existed, it has none)."""
    return and_(G.c.status == "scoring", or_(G.c.lease_until.is_(None), G.c.lease_until < now))


async def claim_group(
    conn: AsyncConnection, group_id: str | None, claim: Claim, now: float
) -> str | None:
    """Lease a group to `claim.owner` and return its id: the given one, else the oldest ready
    one (or one whose lease expired). Rows another transaction is claiming are skipped (Postgres
    `FOR UPDATE SKIP LOCKED`; SQLite's write lock already serialises claims)."""
    if group_id is None:
        claimable = or_(G.c.status == "ready", _lease_expired(now))
        row = (
            await conn.execute(
                select(G.c.id)
                .where(claimable)
                .order_by(G.c.ready_at, G.c.id)
                .limit(1)
                .with_for_update(skip_locked=True)
            )
        ).first()
        if row is None:
            return None
        group_id = row.id
    else:
        claimable = or_(G.c.status.in_(CLAIMABLE), _lease_expired(now))
    result = await conn.execute(
        update(G)
        .where(G.c.id == group_id, claimable, G.c.member_count >= 2)
        .values(
            status="scoring",
            claimed_by=claim.owner,
            lease_until=now + claim.lease_s,
            updated_at=now,
        )
    )
    return group_id if result.rowcount == 1 else None


def _held_by(group_id: str, owner: str) -> Any:
    return and_(G.c.id == group_id, G.c.status == "scoring", G.c.claimed_by == owner)


async def renew_claim(conn: AsyncConnection, group_id: str, claim: Claim, now: float) -> bool:
    """Push the lease of a group `claim.owner` still holds; False when it holds it no more."""
    result = await conn.execute(
        update(G)
        .where(_held_by(group_id, claim.owner))
        .values(lease_until=now + claim.lease_s, updated_at=now)
    )
    return result.rowcount == 1


async def finish_scoring(
    conn: AsyncConnection, group_id: str, owner: str, outcome: JudgeOutcome, now: float
) -> bool:
    """Store the outcome if `owner` still holds the claim (an expired lease nobody took over
    still counts); False, writing nothing, when another scorer has the group now."""
    result = await conn.execute(
        update(G)
        .where(_held_by(group_id, owner))
        .values(
            status=outcome.status,
            scored_at=now,
            updated_at=now,
            claimed_by=None,
            lease_until=None,
            judge_model=outcome.judge_model,
            rubric_hash=outcome.rubric_hash,
            judge_latency_s=outcome.latency_s,
            judge_attempts=outcome.attempts,
            judge_prompt_tokens=outcome.prompt_tokens,
            judge_completion_tokens=outcome.completion_tokens,
            judge_cost_usd=outcome.cost_usd,
            failure=outcome.failure,
        )
    )
    if result.rowcount != 1:
        return False
    if outcome.scores:
        await conn.execute(
            insert(S),
            [
                {
                    "group_id": group_id,
                    "member_id": s.member_id,
                    "score": s.score,
                    "explanation": s.explanation,
                    "judge_model": s.judge_model,
                    "rubric_hash": s.rubric_hash,
                    "latency_s": s.latency_s,
                    "prompt_tokens": s.prompt_tokens,
                    "completion_tokens": s.completion_tokens,
                    "cost_usd": s.cost_usd,
                    "created_at": now,
                }
                for s in outcome.scores
            ],
        )
    return True


async def release_scoring(
    conn: AsyncConnection, group_id: str | None, owner: str, now: float
) -> int:
    """Put "scoring" groups back to "ready": the one `owner` holds, or (no id) every one whose
    lease has expired. Another scorer's live lease is left alone."""
    where = _held_by(group_id, owner) if group_id is not None else _lease_expired(now)
    result = await conn.execute(
        update(G)
        .where(where)
        .values(status="ready", claimed_by=None, lease_until=None, updated_at=now)
    )
    return int(result.rowcount or 0)


async def mark_trained(conn: AsyncConnection, group_ids: list[str], step: int, now: float) -> None:
    if group_ids:
        await conn.execute(
            update(G).where(G.c.id.in_(group_ids)).values(trained_step=step, trained_at=now)
        )
