"""A canary measured close while the publisher lease lapsed (measuring took longer than the lease
on a busy CPU, and nothing renewed it meanwhile) is still promoted once the lease is renewed.

Found on a loaded 2-core machine: the measurement outlasted the lease, the promotion was not
written, and the canary was never measured again; it waited for the reward test with "close" in
its record. `Rollout._close_enough` is driven here with stand-ins for its collaborators (the
closeness measurement itself, which needs the model, is `tests/proxy/test_closeness.py`'s and
the guard's e2e test's); the lease's own behaviour is `tests/proxy/test_lease_keeper.py`'s.
"""

from __future__ import annotations

import asyncio
from typing import Any

from proxy.adapters.closeness import Closeness
from proxy.adapters.rollout import Rollout, RolloutConfig, _Trial


class _Registry:
    policy = "rlproxy"
    active = None


class _Adapters:
    registry = _Registry()

    def __init__(self) -> None:
        self.activated: list[int] = []

    async def activate(self, version: int) -> None:
        self.activated.append(version)


class _Store:
    def __init__(self, state_written: bool = True) -> None:
        self.state_written = state_written
        self.states: list[dict[str, Any]] = []

    async def set_policy_state(self, policy: str, **changes: Any) -> bool:
        self.states.append(changes)
        return self.state_written


class _Close:
    supported = True

    def __init__(self, rollout: Rollout, lapse: bool) -> None:
        self.rollout, self.lapse = rollout, lapse

    async def measure(self, active: int | None, canary: int, since: float) -> Closeness:
        if self.lapse:  # the lease ran out while this ran
            self.rollout.may_write = lambda: False
        return Closeness(0.02, 0.015, 8, 8, 0.0007, 0, "close")


def _rollout(*, lapse: bool, renewed: bool, state_written: bool = True) -> tuple[Rollout, Any]:
    notes: list[tuple[int, dict[str, Any]]] = []

    async def note(version: int, **changes: Any) -> None:
        notes.append((version, changes))

    adapters, store = _Adapters(), _Store(state_written)
    rollout = Rollout(adapters, store, RolloutConfig(), note)  # type: ignore[arg-type]
    rollout.closeness = _Close(rollout, lapse)  # type: ignore[assignment]

    async def renew() -> bool:
        return renewed

    rollout.renew = renew
    rollout._trial = _Trial(1, None, 0.0, {"state": "canary"})
    return rollout, (adapters, store, notes)


async def test_a_close_canary_is_promoted_after_the_lease_is_renewed() -> None:
    rollout, (adapters, store, notes) = _rollout(lapse=True, renewed=True)
    assert await rollout._close_enough(rollout._trial)  # type: ignore[arg-type]
    assert adapters.activated == [1]
    assert store.states[-1]["active_version"] == 1
    assert notes[-1][1]["rollout"]["state"] == "promoted"
    assert rollout.version is None


async def test_a_close_canary_is_left_to_the_replica_that_took_the_lease() -> None:
    rollout, (adapters, store, _) = _rollout(lapse=True, renewed=False)
    assert await rollout._close_enough(rollout._trial)  # type: ignore[arg-type]
    assert adapters.activated == [] and store.states == []
    assert rollout.version is None  # forgotten: the holder resumes it from its record


async def test_a_close_canary_whose_state_changed_meanwhile_is_abandoned() -> None:
    rollout, (adapters, _, notes) = _rollout(lapse=False, renewed=True, state_written=False)
    assert await rollout._close_enough(rollout._trial)  # type: ignore[arg-type]
    assert adapters.activated == []
    assert notes[-1][1]["rollout"]["state"] == "abandoned"


async def test_the_lease_is_renewed_while_closeness_is_measured() -> None:
    """Measuring took longer than the lease on a loaded machine: the next poll's renewal failed,
    the trial was dropped and started again, and measured again, forever."""
    rollout, (adapters, _, _) = _rollout(lapse=False, renewed=True)
    renewals: list[float] = []

    async def renew() -> bool:
        renewals.append(1.0)
        return True

    class _Slow(_Close):
        async def measure(self, active: int | None, canary: int, since: float) -> Closeness:
            await asyncio.sleep(0.35)
            return await super().measure(active, canary, since)

    rollout.renew, rollout.renew_every_s = renew, 0.1
    rollout.closeness = _Slow(rollout, lapse=False)  # type: ignore[assignment]
    assert await rollout._close_enough(rollout._trial)  # type: ignore[arg-type]
    assert len(renewals) >= 3 and adapters.activated == [1]
