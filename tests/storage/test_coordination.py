"""Several replicas on one database (SQLite file, Postgres schema): two stores play two replicas.
A live lease is never taken and an expired one is; racing replicas get it once; the policy's
state is one row both see; a replica's heartbeat lists what it keeps loaded.

Time is passed in (`now=`) where a lease must run out, so no test waits for one.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.storage.conftest import Database

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_a_live_lease_is_kept_and_an_expired_one_taken_over(db: Database) -> None:
    a, b = await db.open(), await db.open()
    now = time.time()
    assert await a.acquire_lease("trainer", "A", 30, now=now)
    assert not await b.acquire_lease("trainer", "B", 30, now=now + 1)
    assert await a.acquire_lease("trainer", "A", 30, now=now + 20)  # renewed to now + 50
    assert not await b.acquire_lease("trainer", "B", 30, now=now + 40)
    held = await b.get_lease("trainer")
    assert held is not None and held.holder == "A" and held.acquired_at == now
    assert held.expires_at == now + 50
    # A dies (no renewal): once the lease has run out, B takes it; A cannot renew it then.
    assert await b.acquire_lease("trainer", "B", 30, now=now + 51)
    assert not await a.acquire_lease("trainer", "A", 30, now=now + 52)
    taken = await a.get_lease("trainer")
    assert taken is not None and taken.holder == "B" and taken.acquired_at == now + 51


async def test_a_released_lease_is_free_at_once_and_other_names_are_separate(
    db: Database,
) -> None:
    a, b = await db.open(), await db.open()
    assert await a.acquire_lease("trainer", "A", 30)
    assert await b.acquire_lease("publisher", "B", 30)
    assert not await b.release_lease("trainer", "B")  # not its own
    assert not await b.acquire_lease("trainer", "B", 30)
    assert await a.release_lease("trainer", "A")
    assert await b.get_lease("trainer") is None
    assert await b.acquire_lease("trainer", "B", 30)


async def test_replicas_racing_for_a_new_lease_get_it_once(db: Database) -> None:
    stores = [await db.open() for _ in range(4)]
    for round_ in range(3):
        name = f"job-{round_}"
        held = await asyncio.gather(
            *(s.acquire_lease(name, f"R{i}", 30) for i, s in enumerate(stores))
        )
        assert sum(held) == 1, held


async def test_the_policy_state_is_one_row_every_replica_reads(db: Database) -> None:
    a, b = await db.open(), await db.open()
    assert await b.get_policy_state("policy") is None
    await a.set_policy_state("policy", by="A", active_version=3)
    state = await b.get_policy_state("policy")
    assert state is not None and state.active_version == 3 and state.canary_version is None
    assert state.changed_by == "A"
    await b.set_policy_state("policy", by="B", canary_version=4, canary_share=0.25)
    state = await a.get_policy_state("policy")
    assert state is not None
    assert (state.active_version, state.canary_version, state.canary_share) == (3, 4, 0.25)
    await a.set_policy_state("policy", active_version=4, canary_version=None, canary_share=None)
    state = await b.get_policy_state("policy")
    assert state is not None and (state.active_version, state.canary_version) == (4, None)
    assert await b.get_policy_state("other") is None
    with pytest.raises(ValueError):
        await a.set_policy_state("policy", version=5)


async def test_heartbeats_list_what_each_live_replica_keeps(db: Database) -> None:
    a, b = await db.open(), await db.open()
    await a.heartbeat_replica("A", "policy", [3, 1])
    await b.heartbeat_replica("B", "policy", [4])
    await b.heartbeat_replica("B", "policy", [4, 5])
    await b.heartbeat_replica("C", "other", [9])
    live = await a.live_replicas("policy", since=time.time() - 60)
    assert [(r.id, r.versions) for r in live] == [("A", (1, 3)), ("B", (4, 5))]
    assert await a.live_replicas("policy", since=time.time() + 60) == []
    await a.remove_replica("A")
    assert [r.id for r in await b.live_replicas("policy", since=0)] == ["B"]


async def test_a_policy_state_change_can_require_what_it_replaces(db: Database) -> None:
    """A rollout's decision is written only over the canary it decided on: a hand that changed
    the state meanwhile (an activation on another replica) is not undone."""
    a, b = await db.open(), await db.open()
    # nothing recorded yet: a missing row counts as holding the expected values
    assert await a.set_policy_state(
        "policy", expect={"active_version": 2}, canary_version=3, canary_share=0.25
    )
    state = await b.get_policy_state("policy")
    assert state is not None and (state.active_version, state.canary_version) == (2, 3)
    await b.set_policy_state("policy", by="hand", active_version=7, canary_version=None)
    assert not await a.set_policy_state(
        "policy", expect={"canary_version": 3}, active_version=3, canary_version=None
    )
    assert not await a.set_policy_state(
        "policy", expect={"active_version": 2}, canary_version=4, canary_share=0.25
    )
    state = await a.get_policy_state("policy")
    assert state is not None and (state.active_version, state.canary_version) == (7, None)
    assert state.changed_by == "hand"
    assert await a.set_policy_state("policy", expect={"canary_version": None}, canary_version=8)
    state = await b.get_policy_state("policy")
    assert state is not None and (state.active_version, state.canary_version) == (7, 8)
