"""Several `rlproxy serve` replicas on one database acting as one deployment.

What the replicas share through the database (`storage.coordination_ops`):

- a lease per job only one of them may run: `trainer:<policy>` (the supervised trainer child,
  `proxy.cli.trainer_process`) and `publisher:<policy>` (publishing new versions and deciding
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

import logging
import os
import socket
import time
import uuid
from typing import Any

from storage.store import Store

logger = logging.getLogger(__name__)


def default_replica_id() -> str:
    """host:pid:random, unique for each start of a replica (a restarted replica is a new one)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


def trainer_lease_name(policy: str) -> str:
    return f"trainer:{policy}"


def publisher_lease_name(policy: str) -> str:
    return f"publisher:{policy}"


class LeaseKeeper:
    """One replica's side of a lease: `await tick()` takes or renews it (call it at least every
    `ttl_s / 3`), `held` says whether it held it at the last tick, `release()` gives it up."""

    def __init__(self, store: Store, name: str, holder: str, ttl_s: float) -> None:
        if ttl_s <= 0:
            raise ValueError("a lease's length must be positive")
        self.store = store
        self.name = name
        self.holder = holder
        self.ttl_s = ttl_s
        self.held = False
        self.since: float | None = None
        self.error: str | None = None

    @property
    def renew_every_s(self) -> float:
        return self.ttl_s / 3

    async def tick(self) -> bool:
        """Take or renew the lease; False when another replica holds it or the database could
        not be asked (then this replica stops acting as the holder: better no trainer for a
        moment than two)."""
        try:
            held = await self.store.acquire_lease(self.name, self.holder, self.ttl_s)
            self.error = None
        except Exception as exc:
            logger.warning("lease %s could not be renewed: %s", self.name, exc)
            self.error = f"{type(exc).__name__}: {exc}"
            held = False
        if held and not self.held:
            self.since = time.time()
            logger.info("this replica (%s) holds the lease %s", self.holder, self.name)
        elif self.held and not held:
            self.since = None
            logger.warning("this replica (%s) lost the lease %s", self.holder, self.name)
        self.held = held
        return held

    async def release(self) -> None:
        if not self.held:
            return
        self.held, self.since = False, None
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
