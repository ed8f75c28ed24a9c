"""Several `rlproxy serve` replicas on one database acting as one deployment.

What the replicas share through the database (`storage.coordination_ops`):

- a lease per job only one of them may run: `trainer:<policy>` (the supervised trainer child,
  `proxy.trainer_child`) and `publisher:<policy>` (publishing new versions and deciding
  canaries, `proxy.adapters.publisher`). `LeaseKeeper` takes a lease, renews it while its job
  runs, and gives it up on a clean stop; a replica that dies (SIGKILL) stops renewing and
  another one takes the lease over once it has expired (`RLPROXY_LEASE_S`).
- the policy's state (active version, canary and its share): one row every replica follows on
  each poll of its publisher (`RLPROXY_ADAPTER_POLL_S`).
- each replica's heartbeat with the adapter versions it keeps loaded: on a shared engine (vLLM)
  a version is unloaded from the engine only when no other live replica keeps it and the
  policy's state does not name it (`SharedVersions`).

With one replica all of it still runs and changes nothing: the replica holds both leases.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

from proxy.adapters.registry import adapter_name
from storage.store import Store

logger = logging.getLogger(__name__)


def default_replica_id() -> str:
    """host:pid:random, unique for each start of a replica (a restarted replica is a new one)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


def trainer_lease_name(policy: str) -> str:
    return f"trainer:{policy}"


PRESENCE_TTL_S = 15.0
"""How long a trainer's announcement holds without renewal (`rlproxy train` renews it)."""


def trainer_presence_name(policy: str) -> str:
    """The lease a running `rlproxy train` of `policy` renews, whoever started it: servers that
    train nothing themselves judge groups only while some trainer uses the scores."""
    return f"trainer-present:{policy}"


def publisher_lease_name(policy: str) -> str:
    return f"publisher:{policy}"


class LeaseKeeper:
    """One replica's side of a lease: `await tick()` takes or renews it (call it at least every
    `ttl_s / 3`), `held` says whether it held it at the last tick, `release()` gives it up.

    Holding is bounded by time, not only by the last tick's answer: a successful tick makes the
    lease this replica's until `valid_until` (the local monotonic clock when the renewal was
    queued, plus `ttl_s`: the database's expiry is at least that late). A tick that fails (the
    database unreachable, or no answer within `ttl_s / 3`) does not end it at once, so a short
    database blip does not stop a trainer; `still_held()` turns False `margin_s` (a quarter of
    the lease) before `valid_until`, which leaves a job that time to stop before another
    replica can take the lease over. A tick that finds another replica holding it ends it."""

    def __init__(
        self,
        store: Store,
        name: str,
        holder: str,
        ttl_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError("a lease's length must be positive")
        self.store = store
        self.name = name
        self.holder = holder
        self.ttl_s = ttl_s
        self.clock = clock
        self.held = False
        self.since: float | None = None
        self.error: str | None = None
        self.valid_until: float | None = None
        """`clock()` time before which no other replica can have taken the lease (None: not
        held)."""

    @property
    def renew_every_s(self) -> float:
        return self.ttl_s / 3

    @property
    def margin_s(self) -> float:
        """How long before `valid_until` this replica stops acting as the holder."""
        return self.ttl_s / 4

    def seconds_left(self) -> float:
        """How long this replica may still act as the holder (<= 0: no longer)."""
        if self.valid_until is None:
            return 0.0
        return self.valid_until - self.margin_s - self.clock()

    def still_held(self) -> bool:
        """Whether this replica may act as the holder now (checked before each write a holder
        makes, and between ticks)."""
        held = self.held and self.seconds_left() > 0
        if self.held and not held:
            self._lost("its time ran out without a renewal")
        return held

    def kill_by_s(self) -> float:
        """Seconds from now by which a job run under the lease must be gone: half the margin
        before `valid_until` (0: at once)."""
        if self.valid_until is None:
            return 0.0
        return max(0.0, self.valid_until - self.margin_s / 2 - self.clock())

    async def tick(self) -> bool:
        """Take or renew the lease; True while this replica may act as the holder: the renewal
        succeeded, or it failed (the database could not be asked in time) but the last one is
        still good for more than `margin_s`. False when another replica holds it."""
        submitted = self.clock()
        timeout = self.renew_every_s
        if self.held:  # never wait past the moment the lease must count as lost
            timeout = min(timeout, max(self.seconds_left(), 0.0))
        answer: bool | None
        try:
            answer = await asyncio.wait_for(
                self.store.acquire_lease(self.name, self.holder, self.ttl_s), timeout
            )
            self.error = None
        except Exception as exc:  # TimeoutError included: a hung connection is a failure
            logger.warning("lease %s could not be renewed: %s", self.name, exc or type(exc))
            self.error = f"{type(exc).__name__}: {exc}"
            answer = None
        if answer is True:
            self.valid_until = submitted + self.ttl_s
        elif answer is False:
            self.valid_until = None
        held = self.valid_until is not None and self.seconds_left() > 0
        if held and not self.held:
            self.since = time.time()
            logger.info("this replica (%s) holds the lease %s", self.holder, self.name)
        elif self.held and not held:
            self._lost("another replica holds it" if answer is False else "renewals failed")
        self.held = held
        return held

    def _lost(self, why: str) -> None:
        # valid_until stays (None only when another replica holds it): a job under the lease
        # still has until then to stop (`kill_by_s`)
        self.held, self.since = False, None
        logger.warning("this replica (%s) lost the lease %s: %s", self.holder, self.name, why)

    async def release(self) -> None:
        if not self.held:
            return
        self.held, self.since, self.valid_until = False, None, None
        try:
            await self.store.release_lease(self.name, self.holder)
        except Exception as exc:
            logger.warning("lease %s could not be released (it expires): %s", self.name, exc)

    async def status(self) -> dict[str, Any]:
        """For /health: who holds the lease and until when (None: nobody)."""
        out: dict[str, Any] = {"name": self.name, "replica": self.holder, "held": self.held}
        try:
            lease = await self.store.get_lease(self.name)
        except Exception as exc:
            out["error"] = f"{type(exc).__name__}: {exc}"
            return out
        live = lease is not None and lease.expires_at >= time.time()
        out["holder"] = lease.holder if lease is not None and live else None
        out["expires_at"] = lease.expires_at if lease is not None and live else None
        if self.error:
            out["error"] = self.error
        return out


class SharedVersions:
    """On an engine several replicas share: which adapter versions another replica still needs
    (kept by a live replica, or named active or canary by the policy's state)."""

    def __init__(self, store: Store, policy: str, replica_id: str, stale_s: float) -> None:
        self.store = store
        self.policy = policy
        self.replica_id = replica_id
        self.stale_s = stale_s

    async def heartbeat(self, versions: list[int]) -> None:
        await self.store.heartbeat_replica(self.replica_id, self.policy, versions)

    async def leave(self) -> None:
        try:
            await self.store.remove_replica(self.replica_id)
        except Exception as exc:
            logger.warning("could not remove this replica's heartbeat (it goes stale): %s", exc)

    async def needed_elsewhere(self) -> set[int] | None:
        """Versions this replica must not unload from the shared engine: the ones another live
        replica keeps (its heartbeat's list: active, previous, canary) and the ones the policy's
        state names. None when the database cannot be asked: then nothing is unloaded."""
        try:
            replicas = await self.store.live_replicas(self.policy, time.time() - self.stale_s)
            state = await self.store.get_policy_state(self.policy)
        except Exception as exc:
            logger.warning("which versions other replicas serve is unknown: %s", exc)
            return None
        needed = {v for r in replicas if r.id != self.replica_id for v in r.versions}
        if state is not None:
            needed.add(state.active_version)
            if state.canary_version is not None:
                needed.add(state.canary_version)
        needed.discard(0)
        return needed

    async def adapters_needed_elsewhere(self) -> set[str] | None:
        """`needed_elsewhere` by the engine's adapter names (`v3`): what the vllm engine must
        leave loaded when a vLLM server rejoins (`VLLMEngine.needed_elsewhere`)."""
        versions = await self.needed_elsewhere()
        return None if versions is None else {adapter_name(v) for v in versions}
