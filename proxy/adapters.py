"""Adapter versions on the serving side: validate, load into the engine, then publish.

A version lives in `<data-dir>/checkpoints/<policy>/<NNNN>/` (PEFT's `adapter_config.json` and
`adapter_model.safetensors`, nothing else executable). Loading validates the files first, loads
into the engine, and only then records the version as served; activating flips the policy name
to it. A version that fails any step never becomes current: the previous one keeps serving.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

from safetensors import safe_open

from proxy.engine.base import Engine
from proxy.errors import InvalidRequestError, NotFoundError
from proxy.registry import ServedModels, adapter_name

logger = logging.getLogger(__name__)

REQUIRED_FILES = ("adapter_config.json", "adapter_model.safetensors")


class AdapterManager:
    def __init__(self, engine: Engine, registry: ServedModels, checkpoints: Path) -> None:
        self.engine = engine
        self.registry = registry
        self.checkpoints = checkpoints
        self._locks: dict[int, asyncio.Lock] = {}

    def path_for(self, version: int) -> Path:
        return self.checkpoints / f"{version:04d}"

    def available(self) -> list[int]:
        if not self.checkpoints.is_dir():
            return []
        return sorted(int(p.name) for p in self.checkpoints.iterdir() if p.name.isdigit())

    async def load(self, version: int) -> None:
        lock = self._locks.setdefault(version, asyncio.Lock())
        async with lock:
            if version in self.registry.loaded_versions():
                return
            path = self.path_for(version)
            await asyncio.to_thread(validate_adapter_dir, path)
            try:
                await self.engine.load_adapter(adapter_name(version), str(path))
            except Exception as exc:
                raise InvalidRequestError(
                    f"adapter version {version} was rejected by the engine: {exc}",
                    param="version",
                    code="adapter_rejected",
                ) from exc
            self.registry.add_version(version)

    async def activate(self, version: int | None) -> None:
        if version is not None:
            await self.load(version)
        self.registry.activate(version)
        logger.info("policy %s now serves %s", self.registry.policy, version or "the base model")

    def describe(self) -> list[dict[str, object]]:
        loaded = set(self.registry.loaded_versions())
        versions = sorted(loaded | set(self.available()))
        return [
            {
                "version": v,
                "id": f"{self.registry.policy}@{v}",
                "path": str(self.path_for(v)),
                "loaded": v in loaded,
                "active": v == self.registry.active,
            }
            for v in versions
        ]


def validate_adapter_dir(path: Path) -> None:
    """Refuse a missing, incomplete or corrupt adapter folder before the engine sees it."""
    if not path.is_dir():
        raise NotFoundError(f"no adapter at {path}", param="version", code="adapter_not_found")
    for name in REQUIRED_FILES:
        if not (path / name).is_file():
            raise InvalidRequestError(
                f"adapter at {path} is incomplete: {name} is missing",
                param="version",
                code="adapter_rejected",
            )
    try:
        json.loads((path / "adapter_config.json").read_text())
        with safe_open(str(path / "adapter_model.safetensors"), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (reading every tensor catches truncation)
                f.get_tensor(key)
    except Exception as exc:
        raise InvalidRequestError(
            f"adapter at {path} is corrupt: {exc}", param="version", code="adapter_rejected"
        ) from exc
