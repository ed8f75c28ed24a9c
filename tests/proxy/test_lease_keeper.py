"""A replica's hold on a lease is bounded by time: a failed or hung renewal is tolerated only
while the last good one still covers the lease, and a tick never waits on the database longer
than a third of the lease.

The store is real (SQLite under `tmp_path`); the database going down or hanging is played by a
wrapper around it (an unreachable or stalled Postgres cannot be made to order here), and time
is a clock the test moves, so no test waits for a lease to run out.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Literal

import pytest

from proxy.adapters.deployment import LeaseKeeper
from storage import Store

pytestmark = pytest.mark.asyncio(loop_scope="function")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Database:
    """The real store, or (mode "down") a connection error, or (mode "hung") no answer."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.mode: Literal["up", "down", "hung"] = "up"

    async def acquire_lease(self, name: str, holder: str, ttl_s: float) -> bool:
        if self.mode == "down":
            raise ConnectionRefusedError("database unreachable")
        if self.mode == "hung":
            await asyncio.Event().wait()
        return await self.store.acquire_lease(name, holder, ttl_s)


def _keeper(db: Database, clock: Clock, ttl_s: float = 30.0) -> LeaseKeeper:
    return LeaseKeeper(db, "trainer:p", "A", ttl_s, clock=clock)  # type: ignore[arg-type]


async def test_a_failed_renewal_is_tolerated_until_the_lease_runs_short(store: Store) -> None:
    db, clock = Database(store), Clock()
    keeper = _keeper(db, clock)
    assert await keeper.tick() and keeper.valid_until == clock.now + 30
    db.mode = "down"
    clock.now += 10  # one renewal fails (a database blip): the job goes on
    assert await keeper.tick() and keeper.held and keeper.error is not None
    clock.now += 10  # 20 s after the last good renewal: still more than a quarter left
    assert await keeper.tick() and keeper.still_held()
    # 2.5 s before its end the SIGKILL must be done; half the margin before, it is due
    assert keeper.kill_by_s() == pytest.approx(30 - 7.5 / 2 - 20)
    clock.now += 3  # less than a quarter of the lease (7.5 s) left: no longer the holder
    assert not keeper.still_held() and not keeper.held
    assert keeper.kill_by_s() == pytest.approx(30 - 7.5 / 2 - 23)  # SIGTERM now, SIGKILL then
    assert not await keeper.tick()
    db.mode = "up"  # back: a new tick takes it again (nobody else did)
    assert await keeper.tick() and keeper.valid_until == clock.now + 30


async def test_a_hung_database_fails_the_tick_instead_of_holding_it(store: Store) -> None:
    db, clock = Database(store), Clock()
    keeper = _keeper(db, clock, ttl_s=0.3)
    db.mode = "hung"
    # Without a bound this would wait forever while the lease ran out under the job.
    assert not await asyncio.wait_for(keeper.tick(), 30)
    assert keeper.error is not None and keeper.error.startswith("TimeoutError")


async def test_another_holder_ends_the_hold_at_once(store: Store) -> None:
    db, clock = Database(store), Clock()
    keeper = _keeper(db, clock)
    assert await keeper.tick()
    # B takes it as if A's had expired (its clock says so): A's next tick ends A's hold
    assert await store.acquire_lease("trainer:p", "B", 30, now=(await _expiry(store)) + 1)
    assert not await keeper.tick() and keeper.valid_until is None and keeper.kill_by_s() == 0


async def _expiry(store: Store) -> float:
    lease = await store.get_lease("trainer:p")
    assert lease is not None
    return lease.expires_at


async def test_a_poll_too_slow_to_renew_the_lease_is_refused_at_start(tmp_path: Path) -> None:
    """The publisher renews its lease and writes the heartbeat once per poll: a poll of a third
    of the lease or more would let the lease lapse and the heartbeat go stale between polls."""
    from pydantic import ValidationError

    from proxy.settings import Settings

    with pytest.raises(ValidationError, match=r"RLPROXY_ADAPTER_POLL_S .* under a third"):
        Settings(data_dir=tmp_path, lease_s=15, adapter_poll_s=5)
    assert Settings(data_dir=tmp_path, lease_s=15, adapter_poll_s=4.9).adapter_poll_s == 4.9
