"""The publisher writes the policy's state only while it may, and only over what it read: a
lease that ran out during a long load writes nothing; an activation made by hand while a canary
loaded holds; a state write that failed leaves the version to publish on the next poll; a
replica that lost the lease forgets its canary's trial.

As in test_publisher_follow.py: one real SQLite store, a stand-in engine that records loads
(here its load also plays what happens meanwhile: time passing, a hand on another replica),
real adapter folders. Time for the lease is a clock the test moves.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from proxy.adapters.deployment import LeaseKeeper
from proxy.adapters.manager import AdapterManager
from proxy.adapters.publisher import Publisher
from proxy.adapters.registry import ServedModels
from proxy.adapters.rollout import RolloutConfig
from storage import Store
from tests.proxy.test_publisher_follow import RecordingEngine, _write_version

pytestmark = pytest.mark.asyncio(loop_scope="function")


class SlowEngine(RecordingEngine):
    """Runs `during_load` inside each load (what happens while a real engine loads)."""

    def __init__(self) -> None:
        super().__init__()
        self.during_load: Callable[[str], Awaitable[None]] | None = None

    async def load_adapter(self, name: str, path: str) -> None:
        if self.during_load is not None:
            await self.during_load(name)
        await super().load_adapter(name, path)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _publisher(
    store: Store, root: Path, name: str, *, rollout: bool = False, clock: Clock | None = None
) -> tuple[Publisher, AdapterManager, SlowEngine]:
    engine = SlowEngine()
    manager = AdapterManager(engine, ServedModels("rlproxy"), root)  # type: ignore[arg-type]
    config = RolloutConfig() if rollout else None
    publisher = Publisher(manager, store, config, replica_id=name, lease_s=60)
    if clock is not None:
        publisher.lease = LeaseKeeper(store, "publisher:rlproxy", name, 60, clock=clock)
    return publisher, manager, engine


async def test_a_lease_that_runs_out_during_a_load_writes_nothing(
    store: Store,
    tmp_path: Path,
) -> None:
    root = tmp_path / "checkpoints" / "rlproxy"
    _write_version(root, 1)
    clock = Clock()
    a, ma, engine = _publisher(store, root, "a", clock=clock)

    async def slow(name: str) -> None:
        clock.now += 50  # the load outlasts the lease's last renewal (60 s, a quarter margin)

    engine.during_load = slow
    assert await a.check() is None
    assert await store.get_policy_state("rlproxy") is None and ma.registry.active is None
    engine.during_load = None
    assert await a.check() == 1  # renewed: published on the next poll
    state = await store.get_policy_state("rlproxy")
    assert state is not None and state.active_version == 1


async def test_a_failed_state_write_leaves_the_version_to_publish_again(
    store: Store,
    tmp_path: Path,
) -> None:
    root = tmp_path / "checkpoints" / "rlproxy"
    _write_version(root, 1)
    a, ma, _ = _publisher(store, root, "a")
    real = store.set_policy_state
    failures = [ConnectionResetError("database connection lost")]

    async def flaky(*args: object, **kwargs: object) -> bool:
        if failures:
            raise failures.pop()
        return await real(*args, **kwargs)  # type: ignore[arg-type]

    store.set_policy_state = flaky  # type: ignore[method-assign]
    with pytest.raises(ConnectionResetError):
        await a.check()  # Publisher.run logs it and polls again
    assert await store.get_policy_state("rlproxy") is None
    records = {r.version: r for r in await store.list_adapters("rlproxy")}
    assert 1 not in records or records[1].activated_at is None  # not marked as served
    assert await a.check() == 1
    state = await store.get_policy_state("rlproxy")
    assert state is not None and state.active_version == 1 and ma.registry.active == 1


async def test_an_activation_by_hand_while_a_canary_loads_holds(
    store: Store,
    tmp_path: Path,
) -> None:
    root = tmp_path / "checkpoints" / "rlproxy"
    for version in (1, 2, 3):
        _write_version(root, version)
    await store.set_policy_state("rlproxy", by="a", active_version=1)
    a, ma, engine = _publisher(store, root, "a", rollout=True)
    await ma.activate(1)

    async def hand_on_b(name: str) -> None:
        if name == "v3":  # while 3 loads for its canary, b activates 2 by hand
            await store.set_policy_state(
                "rlproxy", by="b", active_version=2, canary_version=None, canary_share=None
            )

    engine.during_load = hand_on_b
    assert await a.check() is None  # 3 is not put on canary over the hand's choice
    state = await store.get_policy_state("rlproxy")
    assert state is not None and (state.active_version, state.canary_version) == (2, None)
    assert state.changed_by == "b" and ma.registry.canary is None
    await a.check()  # the next poll follows the hand, then tries the canary against it
    state = await store.get_policy_state("rlproxy")
    assert state is not None and (state.active_version, state.canary_version) == (2, 3)
    assert ma.registry.active == 2


async def test_a_replica_that_lost_the_lease_forgets_its_canary_trial(
    store: Store,
    tmp_path: Path,
) -> None:
    root = tmp_path / "checkpoints" / "rlproxy"
    for version in (1, 2):
        _write_version(root, version)
    await store.set_policy_state("rlproxy", by="a", active_version=1)
    a, ma, _ = _publisher(store, root, "a", rollout=True)
    await ma.activate(1)
    assert await a.check() == 2 and a.rollout is not None and a.rollout.version == 2
    # b takes the lease as if a's had expired (a stalled); a's next poll finds it gone
    lease = await store.get_lease("publisher:rlproxy")
    assert lease is not None
    assert await store.acquire_lease("publisher:rlproxy", "b", 60, now=lease.expires_at + 1)
    assert await a.check() is None
    assert a.rollout.version is None  # b decides now; a's trial would be stale if it led again
    assert time.time() < lease.expires_at  # (a's own clock never saw its lease expire)
