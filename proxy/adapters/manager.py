"""Adapter versions on the serving side: validate, load, activate, and unload what is not kept.

A version lives in `<data-dir>/checkpoints/<policy>/<NNNN>/` (the layout is
`trainer.checkpoints`'; serving reads PEFT's `adapter_config.json` and
`adapter_model.safetensors`, nothing executable). Loading validates the files first, loads into
the engine, and only then records the version as served; activating flips the policy name to it.
A version that fails any step never becomes current: the previous one keeps serving.

What stays loaded: the active version and the `keep_previous` versions that were active before it
(for a quick rollback). Every other version is unloaded after each activation; the engine frees
its weights once no request in flight uses it (requests finish on the version they started
with). A client that pins an unloaded `NAME@N` gets it loaded again on demand; it stays until the
next activation.

On an engine several replicas share (vLLM; `shared` given, `proxy.adapters.deployment`), a
version another live replica keeps, or that the database names active or canary, stays loaded
here too until nobody needs it (a later `evict`, on each publisher poll, unloads it then).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from proxy.adapters.deployment import SharedVersions
from proxy.adapters.registry import ServedModels, adapter_name
from proxy.engines.base import Engine
from proxy.errors import APIError, InvalidRequestError, NotFoundError
from trainer import checkpoints

logger = logging.getLogger(__name__)


class AdapterManager:
    def __init__(
        self,
        engine: Engine,
        registry: ServedModels,
        root: Path,
        *,
        keep_previous: int = 2,
        shared: SharedVersions | None = None,
    ) -> None:
        if keep_previous < 0:
            raise ValueError("keep_previous must be >= 0")
        self.engine = engine
        self.registry = registry
        self.root = root
        self.keep_previous = keep_previous
        self._locks: dict[int, asyncio.Lock] = {}
        self._history: list[int] = []  # versions activated, oldest first, no repeats
        self.swaps = 0  # activations that changed what the policy name serves
        self._evicting = asyncio.Lock()
        self.shared = shared
        """Set when the engine is shared with other replicas: what they still need."""
        self._deferred: set[int] = set()  # not kept here, but needed by another replica
        self._on_demand: set[int] = set()  # pinned `NAME@N` loaded here until the next evict

    def path_for(self, version: int) -> Path:
        return checkpoints.version_dir(self.root, version)

    def shown_path(self, version: int) -> str:
        """The folder as clients see it: relative to the data directory, never the server's
        own absolute paths."""
        return f"checkpoints/{self.root.name}/{self.path_for(version).name}"

    def _public(self, message: str, version: int) -> str:
        return message.replace(str(self.path_for(version)), self.shown_path(version)).replace(
            str(self.root), f"checkpoints/{self.root.name}"
        )

    def available(self) -> list[int]:
        """Versions on disk, ascending."""
        return checkpoints.list_versions(self.root)

    def kept(self) -> set[int]:
        """The versions that stay loaded: the active one, the ones active before it, and a
        version on canary."""
        active = self.registry.active
        previous = [v for v in reversed(self._history) if v != active][: self.keep_previous]
        canary = self.registry.canary
        trial = {canary.version} if canary is not None else set()
        return set(previous) | ({active} if active is not None else set()) | trial

    def in_use(self) -> set[int]:
        """What this replica's heartbeat lists: the kept versions and those loaded on demand for
        a pinned `NAME@N` (until the next activation's evict), so that no replica on a shared
        engine unloads them meanwhile. Versions left loaded only for others are not listed."""
        loaded = set(self.registry.loaded_versions())
        return self.kept() | (self._on_demand & loaded)

    async def load(self, version: int) -> None:
        lock = self._locks.setdefault(version, asyncio.Lock())
        async with lock:
            if version in self.registry.loaded_versions():
                return
            path = self.path_for(version)
            try:
                await asyncio.to_thread(checkpoints.validate_adapter, path)
            except checkpoints.CheckpointMissing as exc:
                raise NotFoundError(
                    f"No adapter version {version} (no folder {self.shown_path(version)}).",
                    param="version",
                    code="adapter_not_found",
                ) from exc
            except checkpoints.CheckpointError as exc:
                raise InvalidRequestError(
                    self._public(str(exc), version), param="version", code="adapter_rejected"
                ) from exc
            try:
                await self.engine.load_adapter(adapter_name(version), str(path))
            except Exception as exc:
                logger.warning("the engine rejected adapter version %d: %s", version, exc)
                raise InvalidRequestError(
                    f"adapter version {version} was rejected by the engine: "
                    f"{self._public(str(exc), version)}",
                    param="version",
                    code="adapter_rejected",
                ) from exc
            self.registry.add_version(version)

    async def activate(self, version: int | None) -> None:
        """Serve `version` (None: the base model) under the policy name; unload what is not kept."""
        if version is not None:
            await self.load(version)
        if version != self.registry.active:
            self.swaps += 1
        self.registry.activate(version)
        if version is not None:
            self._history = [v for v in self._history if v != version] + [version]
            del self._history[: -(self.keep_previous + 1)]
        logger.info("policy %s now serves %s", self.registry.policy, version or "the base model")
        await self.evict()

    async def unload(self, version: int) -> bool:
        """Unload a version that is not active; False if it was not loaded."""
        if version == self.registry.active:
            raise InvalidRequestError(
                f"adapter version {version} is active; activate another version first",
                param="version",
                code="adapter_active",
            )
        canary = self.registry.canary
        if canary is not None and canary.version == version:
            raise InvalidRequestError(
                f"adapter version {version} is on canary; wait for the rollout's decision",
                param="version",
                code="adapter_active",
            )
        if version not in self.registry.loaded_versions():
            return False
        if self.shared is not None:
            needed = await self.shared.needed_elsewhere()
            if needed is None or version in needed:
                raise InvalidRequestError(
                    f"adapter version {version} is still served by another replica on the "
                    "shared engine (or the database cannot say which versions are); it is "
                    "unloaded once none serves it",
                    param="version",
                    code="adapter_in_use",
                )
        await self._drop(version)
        return True

    async def _drop(self, version: int) -> None:
        self._on_demand.discard(version)
        self.registry.remove_version(version)
        await self.engine.unload_adapter(adapter_name(version))
        logger.info("adapter version %d unloaded", version)

    async def evict(self) -> list[int]:
        """Unload every loaded version that is not kept; return them."""
        async with self._evicting:
            keep = self.kept()
            self._on_demand &= keep  # a pin's load lasts until here: no longer listed as in use
            gone = [v for v in self.registry.loaded_versions() if v not in keep]
            if gone and self.shared is not None:
                needed = await self.shared.needed_elsewhere()
                wanted = gone
                gone = [] if needed is None else [v for v in gone if v not in needed]
                self._deferred = set(wanted) - set(gone)
                if self._deferred:
                    logger.info(
                        "adapter versions %s stay loaded: another replica still serves them",
                        sorted(self._deferred),
                    )
            for version in gone:
                await self._drop(version)
            return gone

    async def evict_deferred(self) -> list[int]:
        """Unload the versions an earlier `evict` left loaded for another replica, once none
        needs them (called on each publisher poll); return them."""
        if not self._deferred:
            return []
        return await self.evict()

    async def ensure_servable(self, model: str) -> None:
        """Load `NAME@N` on demand when a client pins a version that is on disk, not loaded."""
        version = self.registry.pinned(model)
        if version is None:
            return
        if version in self.registry.loaded_versions() or not self.path_for(version).is_dir():
            return
        try:
            await self.load(version)
        except APIError as exc:
            raise NotFoundError(
                f"The model `{model}` cannot be served: {exc.message}",
                param="model",
                code="model_not_found",
            ) from exc
        logger.info("adapter version %d loaded on demand", version)
        self._on_demand.add(version)
        if self.shared is not None:  # at once: another replica may evict it before our next poll
            try:
                await self.shared.heartbeat(sorted(self.in_use()))
            except Exception as exc:
                logger.warning("heartbeat after loading version %d failed: %s", version, exc)

    def describe(self) -> list[dict[str, object]]:
        loaded = set(self.registry.loaded_versions())
        canary = self.registry.canary
        versions = sorted(loaded | set(self.available()))
        return [
            {
                "version": v,
                "id": self.registry.version_id(v),
                "path": self.shown_path(v),
                "loaded": v in loaded,
                "active": v == self.registry.active,
                "canary": canary is not None and v == canary.version,
            }
            for v in versions
        ]
