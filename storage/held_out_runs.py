"""The SQL of the held-out evaluation: what each held-out trajectory was served by, and its reward.

`held_out_runs` reads the newest `limit` trajectories marked held out (`storage.held_out`),
optionally of one API key, by the index `ix_trajectories_held_out` (or the owner's), then, in
one query each, the distinct (version, engine, requested name) of their calls and their latest
environment reward. Bounded by `limit` whatever the database holds; never on a request's path
(the evaluation runs on demand: `rlproxy eval`, `rlproxy status`, `GET /rl/eval`).

Held-out trajectories are never grouped, so the judge never scored one: the reward here is the
environment's only. Which runs count, and the statistics, are `proxy.adapters.evaluation`'s.
Callers go through `storage.store.Store`; nothing else should import this module.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncConnection

from storage.models import calls_table as C
from storage.models import rewards_table as R
from storage.models import trajectories_table as T

_CHUNK = 1000  # trajectory ids per IN (...) query


@dataclass(frozen=True)
class ServedBy:
    """One (version, engine, requested name) that served calls of a trajectory."""

    version: int
    """The adapter version, 0 for the base model."""
    engine: str
    """"local", "vllm" (the policy) or "upstream" (a provider's model)."""
    model_requested: str


@dataclass(frozen=True)
class HeldOutRun:
    """One held-out trajectory as the evaluation reads it."""

    trajectory_id: str
    created_at: float
    status: str
    """"open" or "closed"."""
    served_by: tuple[ServedBy, ...]
    """What served its calls, each distinct triple once, sorted."""
    explicit_reward: float | None
    """The environment's latest reward for it, or None."""
    owner_key_id: str | None = None
    task_signature: str | None = None
    """The task it ran (`storage.linking.task_signature`): re-runs of one task pair on it."""


async def held_out_runs(
    conn: AsyncConnection, *, limit: int, owner: str | None = None
) -> list[HeldOutRun]:
    """The newest `limit` held-out trajectories, oldest first (of API key `owner` only, unless
    None: every key's)."""
    stmt = select(T.c.id, T.c.created_at, T.c.status, T.c.owner_key_id, T.c.task_signature).where(
        T.c.held_out.is_(True)
    )
    if owner is not None:
        stmt = stmt.where(T.c.owner_key_id == owner)
    rows = (await conn.execute(stmt.order_by(T.c.created_at.desc(), T.c.id).limit(limit))).all()
    ids = [r.id for r in rows]
    served: dict[str, set[ServedBy]] = {i: set() for i in ids}
    rewards: dict[str, float] = {}
    for start in range(0, len(ids), _CHUNK):
        chunk = ids[start : start + _CHUNK]
        for c in await conn.execute(
            select(
                C.c.trajectory_id,
                func.coalesce(C.c.adapter_version, 0).label("version"),
                C.c.engine,
                C.c.model_requested,
            )
            .where(C.c.trajectory_id.in_(chunk))
            .distinct()
        ):
            served[c.trajectory_id].add(ServedBy(int(c.version), c.engine, c.model_requested))
        for r in await conn.execute(
            select(R.c.trajectory_id, R.c.reward)
            .where(R.c.trajectory_id.in_(chunk))
            .order_by(R.c.id)
        ):
            rewards[r.trajectory_id] = r.reward  # the latest wins
    return [
        HeldOutRun(
            trajectory_id=r.id,
            created_at=r.created_at,
            status=r.status,
            served_by=tuple(
                sorted(served[r.id], key=lambda s: (s.version, s.engine, s.model_requested))
            ),
            explicit_reward=rewards.get(r.id),
            owner_key_id=r.owner_key_id,
            task_signature=r.task_signature,
        )
        for r in reversed(rows)
    ]
