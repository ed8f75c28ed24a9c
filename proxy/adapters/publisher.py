"""Publishing adapter versions: new checkpoint folders become what the policy name serves.

The trainer (in its own process, or on another machine sharing the checkpoint folder and the
database) writes `checkpoints/<policy>/NNNN/` atomically. `Publisher.check` looks for versions
it has not seen, newest first: the first that validates and loads becomes current (only then does
the policy name flip); one that is corrupt or refused by the engine is recorded as rejected and
never retried, and the version serving before keeps serving. Requests in flight finish on the
version they started with (the engine keeps an adapter until no request uses it); versions no
longer kept are unloaded by `proxy.adapters.manager`.

Each outcome is written to the adapters table, so `GET /rl/adapters` shows it.
"""

from __future__ import annotations

import asyncio
import logging
import time

from proxy.adapters.manager import AdapterManager
from proxy.api.errors import APIError
from storage.records import AdapterRecord
from storage.store import Store

logger = logging.getLogger(__name__)


class Publisher:
    def __init__(self, adapters: AdapterManager, store: Store) -> None:
        self.adapters = adapters
        self.store = store
        self.policy = adapters.registry.policy
        self._seen: set[int] = set()

    async def check(self) -> int | None:
        """Publish the newest unseen version that loads; return it (None: nothing new)."""
        active = self.adapters.registry.active or 0
        unseen = [v for v in self.adapters.available() if v not in self._seen]
        for version in sorted(unseen, reverse=True):
            self._seen.add(version)
            if version <= active:
                continue  # older than what serves now: loadable on demand, not published
            try:
                await self.adapters.activate(version)
            except APIError as exc:
                serving = active or "the base model"
                logger.error(
                    "adapter %d rejected, still serving %s: %s", version, serving, exc.message
                )
                await self._note(version, status="rejected", error=exc.message)
                continue
            now = time.time()
            await self._note(version, status="loaded", loaded_at=now, activated_at=now)
            logger.info("published adapter version %d", version)
            self._seen.update(unseen)
            return version
        return None

    async def note_activation(self, version: int | None) -> None:
        """Record a manual activation (roll back or forward)."""
        if version is not None:
            await self._note(version, activated_at=time.time())

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
