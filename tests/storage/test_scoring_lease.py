"""Scoring leases between replicas: two stores on one database (one SQLite file, one Postgres
schema) play two serving replicas. A live lease is never taken, an expired one is, and a scorer
that lost its claim cannot overwrite the result of the one that took it over.

Time is passed in (`now=`), so no test waits for a lease to run out.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from storage import Store
from storage.grouping import SignatureGrouper
from storage.records import JudgeOutcome, ScoreRecord
from tests.storage.conftest import Database

pytestmark = pytest.mark.asyncio(loop_scope="session")

SYSTEM = {"role": "system", "content": "You solve tasks."}


async def _ready_groups(store: Store, make_call: Any, *tasks: str) -> list[str]:
    """One ready group of two closed runs per task."""
    for task in tasks:
        for _ in range(2):
            messages = [SYSTEM, {"role": "user", "content": task}]
            await store.end_trajectory(await store.record_call(make_call(messages)))
    ready = (await store.form_groups(SignatureGrouper(min_size=2))).ready
    assert len(ready) == len(tasks)
    return ready


def _outcome(store: Store, judge: str, score: float, members: list[str]) -> JudgeOutcome:
    return JudgeOutcome(
        status="scored",
        judge_model=judge,
        scores=[ScoreRecord(m, score, f"by {judge}", judge) for m in members],
    )


async def _members(store: Store, group_id: str) -> list[str]:
    group = await store.get_group(group_id)
    assert group is not None
    return [m.member_id for m in group.members]


async def test_a_live_lease_is_never_taken(db: Database, make_call: Any) -> None:
    a, b = await db.open(), await db.open()
    (gid,) = await _ready_groups(a, make_call, "live lease")
    t = time.time()
    assert await a.claim_group(lease_s=60, now=t) == gid
    # The other replica, starting up or looking for work while A judges, leaves it alone.
    assert await b.release_scoring(now=t + 30) == 0
    assert await b.claim_group(now=t + 30) is None
    assert await b.claim_group(gid, now=t + 30) is None  # not even by id (a rescore request)
    assert await b.release_scoring(gid, now=t + 30) == 0  # nor release it: it is A's
    summary = (await b.get_group(gid)).summary  # type: ignore[union-attr]
    assert summary.status == "scoring"


async def test_an_expired_lease_is_taken_over(db: Database, make_call: Any) -> None:
    a, b = await db.open(), await db.open()
    (gid,) = await _ready_groups(a, make_call, "expired lease")
    members = await _members(a, gid)
    t = time.time()
    assert await a.claim_group(lease_s=60, now=t) == gid
    # A's process died (or stopped renewing): after the lease B takes the group over.
    assert await b.claim_group(lease_s=60, now=t + 61) == gid
    # A comes back with a late result: it holds no claim, so nothing of it is written.
    assert not await a.renew_claim(gid, lease_s=60, now=t + 62)
    assert not await a.finish_scoring(gid, _outcome(a, "judge-a", 0.1, members))
    assert await b.finish_scoring(gid, _outcome(b, "judge-b", 0.9, members))
    group = await a.get_group(gid)
    assert group is not None
    assert group.summary.status == "scored" and group.summary.judge_model == "judge-b"
    assert {m.ruler.explanation for m in group.members if m.ruler} == {"by judge-b"}


async def test_renewing_keeps_the_lease(db: Database, make_call: Any) -> None:
    a, b = await db.open(), await db.open()
    (gid,) = await _ready_groups(a, make_call, "renewed lease")
    t = time.time()
    assert await a.claim_group(lease_s=60, now=t) == gid
    assert await a.renew_claim(gid, lease_s=60, now=t + 50)  # now held until t + 110
    assert await b.claim_group(now=t + 61) is None
    assert await b.claim_group(now=t + 111) == gid


async def test_finishing_after_an_expiry_nobody_acted_on_still_counts(
    db: Database, make_call: Any
) -> None:
    a = await db.open()
    (gid,) = await _ready_groups(a, make_call, "slow but alone")
    members = await _members(a, gid)
    assert await a.claim_group(lease_s=0.001, now=time.time() - 10) == gid
    assert await a.finish_scoring(gid, _outcome(a, "judge-a", 0.5, members))
    group = await a.get_group(gid)
    assert group is not None and group.summary.status == "scored"


async def test_a_released_claim_is_free_for_anyone(db: Database, make_call: Any) -> None:
    a, b = await db.open(), await db.open()
    (gid,) = await _ready_groups(a, make_call, "released")
    assert await a.claim_group() == gid
    assert await a.release_scoring(gid) == 1  # A's scorer was cancelled: it gives the group back
    assert await b.claim_group() == gid


async def test_replicas_claiming_at_once_never_share_a_group(db: Database, make_call: Any) -> None:
    a, b = await db.open(), await db.open()
    tasks = [f"task {i}" for i in range(12)]
    ready = await _ready_groups(a, make_call, *tasks)

    async def claim_all(store: Store) -> list[str]:
        claimed = []
        while (gid := await store.claim_group()) is not None:
            claimed.append(gid)
        return claimed

    # Several claimers per store, as concurrent as the writers allow.
    results = await asyncio.gather(*(claim_all(s) for s in (a, b, a, b)))
    flat = [gid for r in results for gid in r]
    assert len(flat) == len(set(flat)), "a group was claimed twice"
    assert set(flat) == set(ready)
