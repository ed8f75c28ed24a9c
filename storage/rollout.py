"""The SQL of a canary rollout: the rewards of two adapter versions on the same work.

A scored group whose members were served by both versions compares them directly: the judge
saw both answers side by side (and the environment rewarded both runs of one task). For every
such group scored since the canary began, `paired_rewards` returns each version's member
rewards; the statistics live in `proxy.adapters.rollout_stats`.

A member's version is the one that served its first call (a trajectory member) or its call (a
sampled answer), 0 for the base model, as in `storage.stats`. Each member comes with the
environment's latest reward for its trajectory (trajectory members only) and the judge's latest
score, side by side: which counts is the reward policy's choice (`trainer.scoring.rewards`).
Only calls the policy served count (`POLICY_ENGINES`: the local or the vllm engine).

Bounded: the newest `limit` groups scored since `since`, each read by its indexed id.

`calls_served` counts the calls a version served since a time (a canary's call budget), over
the calls made since then (`ix_calls_created_at`); `recent_trajectories` names the newest
trajectories a version served whole (the prompts a canary's closeness is measured on), reading
at most `scan` of the newest calls.
Callers go through `storage.store.Store`; nothing else should import this module.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncConnection

from storage.models import calls_table as C
from storage.models import group_members_table as GM
from storage.models import groups_table as G
from storage.models import rewards_table as R
from storage.models import scores_table as S
from storage.records import POLICY_ENGINES, PairedMember
from storage.stats import member_call


@dataclass(frozen=True)
class GroupPair:
    """One scored group holding members of both versions."""

    group_id: str
    scored_at: float
    members: tuple[PairedMember, ...]
    """The group's members served by either version (members of other versions left out)."""


async def paired_rewards(
    conn: AsyncConnection,
    *,
    old: int,
    new: int | Collection[int],
    since: float,
    limit: int = 1000,
) -> list[GroupPair]:
    """Scored groups since `since` (oldest first, at most the newest `limit`) that hold members
    served by `old` and by `new` (0: the base model; several versions: members of any of them
    count on that side), with each member's rewards."""
    groups = (
        await conn.execute(
            select(G.c.id, G.c.scored_at)
            .where(G.c.status == "scored", G.c.scored_at >= since)
            .order_by(G.c.scored_at.desc(), G.c.id)
            .limit(limit)
        )
    ).all()
    if not groups:
        return []
    ids = [g.id for g in groups]
    members = (
        await conn.execute(
            select(
                GM.c.group_id,
                GM.c.member_id,
                GM.c.trajectory_id,
                GM.c.call_id,
                func.coalesce(C.c.adapter_version, 0).label("version"),
            )
            .select_from(GM)
            .join(C, C.c.id == member_call())
            .where(GM.c.group_id.in_(ids), C.c.engine.in_(POLICY_ENGINES))
        )
    ).all()
    news = {new} if isinstance(new, int) else set(new)
    wanted = {old, *news}
    by_group: dict[str, list[tuple[str, str, str | None, int]]] = {}
    for m in members:
        if m.version in wanted:
            by_group.setdefault(m.group_id, []).append(
                (m.member_id, m.trajectory_id, m.call_id, int(m.version))
            )
    mixed = {
        g: ms
        for g, ms in by_group.items()
        if old not in news and any(v == old for *_, v in ms) and any(v in news for *_, v in ms)
    }
    if not mixed:
        return []
    scores: dict[tuple[str, str], float] = {}
    for s in await conn.execute(
        select(S.c.group_id, S.c.member_id, S.c.score)
        .where(S.c.group_id.in_(list(mixed)))
        .order_by(S.c.id)
    ):
        scores[(s.group_id, s.member_id)] = s.score  # the latest wins
    trajectories = sorted({t for ms in mixed.values() for _, t, call, _ in ms if call is None})
    explicit: dict[str, float] = {}
    if trajectories:
        for r in await conn.execute(
            select(R.c.trajectory_id, R.c.reward)
            .where(R.c.trajectory_id.in_(trajectories))
            .order_by(R.c.id)
        ):
            explicit[r.trajectory_id] = r.reward
    scored_at = {g.id: g.scored_at for g in groups}
    out = []
    for group_id, ms in mixed.items():
        paired = tuple(
            PairedMember(
                version=version,
                explicit=explicit.get(trajectory_id) if call_id is None else None,
                judged=scores.get((group_id, member_id)),
            )
            for member_id, trajectory_id, call_id, version in ms
        )
        out.append(GroupPair(group_id, scored_at[group_id], paired))
    return sorted(out, key=lambda p: (p.scored_at, p.group_id))


async def calls_served(conn: AsyncConnection, *, version: int, since: float) -> int:
    """Calls served by adapter `version` (0: the base model) since `since`, policy engines only."""
    count = await conn.scalar(
        select(func.count())
        .select_from(C)
        .where(
            C.c.created_at >= since,
            func.coalesce(C.c.adapter_version, 0) == version,
            C.c.engine.in_(POLICY_ENGINES),
        )
    )
    return int(count or 0)


async def recent_trajectories(
    conn: AsyncConnection, *, version: int, since: float, limit: int, scan: int = 2000
) -> list[str]:
    """The newest `limit` trajectories (newest first) among the newest `scan` policy calls since
    `since` whose every call there was served by adapter `version` (0: the base model)."""
    rows = (
        await conn.execute(
            select(C.c.trajectory_id, func.coalesce(C.c.adapter_version, 0).label("version"))
            .where(C.c.created_at >= since, C.c.engine.in_(POLICY_ENGINES))
            .order_by(C.c.created_at.desc())
            .limit(scan)
        )
    ).all()
    order: list[str] = []
    versions: dict[str, set[int]] = {}
    for r in rows:
        if r.trajectory_id is None:
            continue
        if r.trajectory_id not in versions:
            order.append(r.trajectory_id)
            versions[r.trajectory_id] = set()
        versions[r.trajectory_id].add(int(r.version))
    return [t for t in order if versions[t] == {version}][:limit]
