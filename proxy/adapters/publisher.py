"""Publishing adapter versions: new checkpoint folders become what the policy name serves.

The trainer (in its own process, or on another machine sharing the checkpoint folder and the
database) writes `checkpoints/<policy>/NNNN/` atomically. `Publisher.check` looks for versions
it has not seen, newest first: the first that validates and loads becomes current (only then does
the policy name flip); one that is corrupt or refused by the engine is recorded as rejected and
never retried, and the version serving before keeps serving. Requests in flight finish on the
version they started with (the engine keeps an adapter until no request uses it); versions no
longer kept are unloaded by `proxy.adapters.manager`.

Each outcome is written to the adapters table, so `GET /rl/adapters` shows it.

With a canary rollout (`rollout` given; `proxy.adapters.rollout`): the newest unseen version
does not take over at once but serves a share of the traffic beside the active one until the
rollout promotes it or rolls it back; newer versions wait meanwhile. On start, the newest
version that was ever active and is not rejected serves again (and a canary that was running
resumes, with the evidence gathered before the restart).

With the forgetting check (`forgetting` given; `proxy.adapters.forgetting`): a version that has
loaded is first compared with the base on general prompts; one that forgot them is held (recorded
rejected, with the verdict: `proxy.adapters.held`), unloaded, and never served; what served before
keeps serving, and an older unseen version may be published instead. It runs here, in the
publisher's background loop, never on a request's path; on an engine that cannot run it (vLLM)
the version serves and its verdict says the check was skipped.

Never published again, whatever the setting: a version the forgetting check held, a version a
rollout rejected (rolled back), and one trained from a rolled-back version (its trainer state's
`parent` chain passes through one; a version without `parent`, written before the trainer
recorded it, counts as trained from the version before it). A version the engine refused is
tried again after a restart, as before.

Several replicas on one database (`proxy.adapters.deployment`): what the policy name serves is
the policy's state in the database (active version, canary and share), written by whoever
changes it (publishing, a rollout's decision, `/rl/adapters/{v}/activate` on any replica). On
every poll each replica first follows that state, then, only if it holds the publisher lease,
publishes new versions and runs the canary's rollout: one replica decides, the others follow
within a poll. The leader writes the policy's state only while its lease still holds
(`LeaseKeeper.still_held`, checked again after a load, which may take seconds), and marks a
version served only after the state names it, so a failed write is retried on the next poll. A
version that was active before is not published again by a new lease holder (a rollback made by
hand holds). Each poll also writes the replica's heartbeat (the versions it
keeps loaded) and unloads versions left loaded for other replicas that none needs any more.
"""

from __future__ import annotations

import asyncio
import logging
import time

from proxy.adapters.closeness import ClosenessCheck
from proxy.adapters.deployment import LeaseKeeper, SharedVersions, publisher_lease_name
from proxy.adapters.forgetting import ForgettingCheck
from proxy.adapters.held import HELD, held_rollout
from proxy.adapters.manager import AdapterManager
from proxy.adapters.rollout import ROLLED_BACK, Rollout, RolloutConfig
from proxy.errors import APIError
from storage.records import AdapterRecord
from storage.store import Store
from trainer import checkpoints

logger = logging.getLogger(__name__)


class Publisher:
    def __init__(
        self,
        adapters: AdapterManager,
        store: Store,
        rollout: RolloutConfig | None = None,
        *,
        replica_id: str | None = None,
        lease_s: float | None = None,
        shared: SharedVersions | None = None,
        forgetting: ForgettingCheck | None = None,
        closeness: ClosenessCheck | None = None,
    ) -> None:
        """`lease_s`: hold the publisher lease (as `replica_id`) to publish and decide; None:
        always publish (one replica alone). `shared`: write this replica's heartbeat.
        `forgetting`: check each new version against the base before it serves (None: off).
        `closeness`: with a rollout, promote a canary provably close to the active version at
        once (`proxy.adapters.closeness`; None: every canary waits for rewards)."""
        self.adapters = adapters
        self.forgetting = forgetting
        self.store = store
        self.policy = adapters.registry.policy
        self.replica_id = replica_id
        self._seen: set[int] = set()
        self.rollout = (
            None
            if rollout is None
            else Rollout(adapters, store, rollout, self._note, closeness=closeness)
        )
        self.lease = (
            None
            if lease_s is None
            else LeaseKeeper(store, publisher_lease_name(self.policy), replica_id or "", lease_s)
        )
        if self.rollout is not None:
            self.rollout.replica_id = replica_id
            self.rollout.may_write = self._leading
            self.rollout.renew = self._renew
            self.rollout.renew_every_s = None if self.lease is None else self.lease.renew_every_s
        self.shared = shared
        self._restored = False
        self._left = False

    async def check(self) -> int | None:
        """Follow the policy's state in the database; then, holding the publisher lease, publish
        the newest unseen version that loads (with a rollout: put it on canary, once the running
        canary is decided); return it (None: nothing new)."""
        if self._left:
            return None
        if self.rollout is not None:  # every replica that publishes routes the watch's share
            self.adapters.registry.watch_share = self.rollout.config.watch_share
        leader = True if self.lease is None else await self.lease.tick()
        await self.follow()
        if self.shared is not None:
            await self.shared.heartbeat(sorted(self.adapters.in_use()))
            await self.adapters.evict_deferred()
        if not leader:
            if self.rollout is not None:
                self.rollout.forget()  # another replica decides now; a trial here is stale
            return None
        if self.rollout is not None:
            return await self._check_rollout(self.rollout)
        if not self._restored:  # a database from before the policy's state was recorded
            await self._restore()
            self._restored = True
        active = self.adapters.registry.active or 0
        unseen = [v for v in self.adapters.available() if v not in self._seen]
        if not unseen:
            return None
        records = {a.version: a for a in await self.store.list_adapters(self.policy)}
        barred = await self._barred(unseen, records)
        for version in sorted(unseen, reverse=True):
            if version <= active or version in barred:
                # older than what serves now (loadable on demand), or never to be published
                self._seen.add(version)
                continue
            if version in records and records[version].activated_at is not None:
                self._seen.add(version)
                continue  # served before and replaced since (a rollback by hand): not again
            try:
                await self.adapters.load(version)  # validated and in the engine, not yet served
            except APIError as exc:
                serving = active or "the base model"
                logger.error(
                    "adapter %d rejected, still serving %s: %s", version, serving, exc.message
                )
                await self._note(version, status="rejected", error=exc.message)
                self._seen.add(version)
                continue
            if not await self._passes_check(version):
                self._seen.add(version)
                continue
            if not self._leading():  # loading took long enough for the lease to run out
                logger.warning("adapter %d not published: the publisher lease ran out", version)
                return None
            # The policy's state first: if that write fails the version stays unseen and is
            # published on the next poll (and by a new lease holder: not marked served yet).
            await self._set_active(version)
            await self.adapters.activate(version)
            now = time.time()
            await self._note(version, status="loaded", loaded_at=now, activated_at=now)
            logger.info("published adapter version %d", version)
            self._seen.update(unseen)
            return version
        return None

    async def _passes_check(self, version: int) -> bool:
        """Run the forgetting check on loaded `version`: True when it may serve (passed, or
        the check is off or cannot run here); False when it is held (recorded and unloaded)."""
        if self.forgetting is None:
            return True
        check = asyncio.ensure_future(self.forgetting.check(version))
        try:
            while self.lease is not None and not check.done():
                # On a CPU it outlasts the lease: renewed meanwhile, as each poll renews it.
                await asyncio.wait({check}, timeout=self.lease.renew_every_s)
                if not check.done():
                    await self.lease.tick()
            verdict = await check
        finally:
            check.cancel()  # stopping (the publisher's task cancelled): the check stops too
        if verdict.state != HELD:
            return True
        serving = self.adapters.registry.active or "the base model"
        logger.error("adapter %d held, still serving %s: %s", version, serving, verdict.reason)
        await self._note(
            version,
            status="rejected",
            error=verdict.reason,
            rollout=held_rollout(verdict.to_dict()),
        )
        await self.adapters.evict()  # not kept: unloaded (on a shared engine, once none needs it)
        return False

    async def _renew(self) -> bool:
        """Renew the publisher lease now (True: this replica still holds it)."""
        return self.lease is None or await self.lease.tick()

    def _leading(self) -> bool:
        """Whether this replica may still write as the publisher (checked before each write of
        the policy's state: a long load may outlast the lease's last renewal)."""
        return self.lease is None or self.lease.still_held()

    async def _check_rollout(self, rollout: Rollout) -> int | None:
        if not self._restored:
            await self._restore()
            self._restored = True
        await rollout.watch()  # what serves, against the base: rolled back if it proves harmful
        canary = self.adapters.registry.canary
        if rollout.version is None and canary is not None:
            # a canary another replica started (it held the lease before): its trial goes on
            # here, with the evidence gathered since it began
            records = {a.version: a for a in await self.store.list_adapters(self.policy)}
            record = records.get(canary.version)
            if not await rollout.start(canary.version, previous=record.rollout if record else None):
                return None  # the state changed meanwhile: the next poll follows it
            self._seen.add(canary.version)
        if rollout.version is not None:
            await rollout.evaluate()
            if rollout.version is not None:
                return None  # still on trial: newer versions wait for its decision
            if not self._leading() or self.adapters.registry.canary is not None:
                # the trial was dropped (the lease lapsed, or the state changed meanwhile):
                # the next poll follows the policy's state before anything new is put on trial
                return None
        active = self.adapters.registry.active or 0
        unseen = [v for v in self.adapters.available() if v > active and v not in self._seen]
        if not unseen:
            return None
        records = {a.version: a for a in await self.store.list_adapters(self.policy)}
        barred = await self._barred(unseen, records)
        for version in sorted(unseen, reverse=True):
            if version in barred:
                self._seen.add(version)
                continue
            record = records.get(version)
            try:
                await self.adapters.load(version)  # checked before it goes on canary
                if not await self._passes_check(version):
                    self._seen.add(version)
                    continue
                started = await rollout.start(version, previous=record.rollout if record else None)
            except APIError as exc:
                logger.error("adapter %d rejected, not put on canary: %s", version, exc.message)
                await self._note(version, status="rejected", error=exc.message)
                self._seen.add(version)
                continue
            if not started:  # the state changed, or the lease ran out: not seen, tried again
                return None
            self._seen.add(version)
            return version
        return None

    async def follow(self) -> None:
        """Serve what the policy's state in the database says: its active version and its
        canary (another replica, or a hand on any replica, may have changed them)."""
        state = await self.store.get_policy_state(self.policy)
        if state is None:
            return  # nothing recorded yet: the lease holder's first publication writes it
        registry = self.adapters.registry
        active = state.active_version or None
        if active != registry.active:
            try:
                await self.adapters.activate(active)
            except APIError as exc:
                logger.error(
                    "the database says %s serves %s, which cannot be served here: %s",
                    self.policy,
                    active or "the base model",
                    exc.message,
                )
                return
            logger.info("following the database: %s serves %s", self.policy, active or "base")
        canary = registry.canary
        if state.canary_version is None:
            if canary is not None:
                registry.end_canary()
                await self.adapters.evict()
            return
        paused = state.canary_share == 0.0  # its rollout spent the call budget
        if canary is not None and canary.version == state.canary_version:
            if paused and canary.share > 0.0:
                registry.pause_canary()
            return
        share = state.canary_share or (self.rollout.config.share if self.rollout else 0.25)
        try:
            await self.adapters.load(state.canary_version)
            registry.start_canary(state.canary_version, share)
            if paused:
                registry.pause_canary()
        except (APIError, ValueError) as exc:
            logger.error("canary %d cannot be served here: %s", state.canary_version, exc)
            return
        logger.info("following the database: %d on canary", state.canary_version)

    async def _set_active(self, version: int | None) -> None:
        await self.store.set_policy_state(
            self.policy,
            by=self.replica_id,
            active_version=version or 0,
            canary_version=None,
            canary_share=None,
        )

    async def _restore(self) -> None:
        """Serve the newest version that was active before (not rejected) again: a database
        from before the policy's state was recorded."""
        if self.adapters.registry.active is not None:
            return
        if await self.store.get_policy_state(self.policy) is not None:
            return
        on_disk = set(self.adapters.available())
        records = await self.store.list_adapters(self.policy)
        served = [
            a.version
            for a in records
            if a.activated_at is not None and a.status != "rejected" and a.version in on_disk
        ]
        for version in sorted(served, reverse=True):
            try:
                await self.adapters.activate(version)
            except APIError as exc:
                logger.error("adapter %d, active before, cannot serve: %s", version, exc.message)
                continue
            logger.info("serving adapter %d again, the last version that was active", version)
            if self._leading():
                await self._set_active(version)
            return

    async def _barred(
        self, versions: list[int], records: dict[int, AdapterRecord] | None = None
    ) -> set[int]:
        """Which of `versions` must never be published: rejected by a rollout, or trained from a
        version that was rolled back (recorded as rejected here, with the reason)."""
        if not versions:
            return set()
        if records is None:
            records = {a.version: a for a in await self.store.list_adapters(self.policy)}
        rolled = {v for v, a in records.items() if _rolled_back(a)}
        trusted = {
            v for v, a in records.items() if a.activated_at is not None and a.status != "rejected"
        }
        barred = {v for v in versions if v in records and _refused_by_rollout(records[v])}
        for version in versions:
            if version in barred or not rolled:
                continue
            ancestor = checkpoints.rolled_back_ancestor(
                self.adapters.root, version, rolled, trusted
            )
            if ancestor is not None:
                barred.add(version)
                reason = f"trained from version {ancestor}, which was rolled back"
                logger.warning("adapter %d not published: %s", version, reason)
                await self._note(
                    version,
                    status="rejected",
                    error=reason,
                    rollout={"state": "rejected", "reason": reason, "ancestor": ancestor},
                )
        return barred

    async def note_activation(self, version: int | None) -> None:
        """Record a manual activation (roll back or forward); every replica follows it."""
        if version is not None:
            await self._note(version, activated_at=time.time())
        await self._set_active(version)

    async def leave(self) -> None:
        """On a clean stop: give the publisher lease up and drop this replica's heartbeat."""
        self._left = True
        if self.lease is not None:
            await self.lease.release()
        if self.shared is not None:
            await self.shared.leave()

    async def run(self, interval_s: float) -> None:
        while True:
            try:
                await self.check()
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("publishing adapters failed; trying again")
            await asyncio.sleep(interval_s)

    async def _note(self, version: int, **changes: object) -> None:
        if not await self.store.update_adapter(self.policy, version, **changes):
            now = time.time()
            record = AdapterRecord(
                policy=self.policy,
                version=version,
                path=str(self.adapters.path_for(version)),
                status="written",
                created_at=now,
                updated_at=now,
            )
            await self.store.record_adapter(record)
            await self.store.update_adapter(self.policy, version, **changes)


def _refused_by_rollout(record: AdapterRecord) -> bool:
    """Rejected by a rollout (rolled back, or trained from a rolled-back version): for good. A
    version the engine refused is tried again after a restart, as before rollouts existed."""
    return record.status == "rejected" and record.rollout is not None


def _rolled_back(record: AdapterRecord) -> bool:
    return bool(record.rollout) and (record.rollout or {}).get("state") == ROLLED_BACK
