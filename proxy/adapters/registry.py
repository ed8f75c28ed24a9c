"""The served-model registry: which names the proxy answers to and which adapter each one means.

    NAME          the policy: the newest active adapter version (the base while there is none)
    NAME@base     the base model, no adapter
    NAME@N        adapter version N, pinned (while it is loaded)
    alias         configured other names (e.g. `gpt-4o-mini`) that mean NAME

The registry only maps names to versions; loading weights is the engine's job, and the
`AdapterManager` (`manager.py`) changes the registry only after an engine load succeeded.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from proxy.api.errors import ModelNotFoundError


def parse_version(suffix: str) -> int | None:
    """The N of `NAME@N`: ASCII digits only, at most nine of them; None for anything else."""
    if 0 < len(suffix) <= 9 and suffix.isascii() and suffix.isdigit():
        return int(suffix)
    return None


def adapter_name(version: int) -> str:
    """The engine-side name of adapter version N."""
    return f"v{version}"


@dataclass(frozen=True)
class Resolved:
    """What a requested model name serves: `version` None means the base model."""

    requested: str
    version: int | None

    @property
    def adapter(self) -> str | None:
        return None if self.version is None else adapter_name(self.version)


@dataclass
class ServedModels:
    policy: str
    aliases: tuple[str, ...] = ()
    created: int = field(default_factory=lambda: int(time.time()))
    _loaded: dict[int, int] = field(default_factory=dict)  # version -> loaded-at time
    _active: int | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def active(self) -> int | None:
        return self._active

    def loaded_versions(self) -> list[int]:
        return sorted(self._loaded)

    def add_version(self, version: int) -> None:
        with self._lock:
            self._loaded.setdefault(version, int(time.time()))

    def remove_version(self, version: int) -> None:
        with self._lock:
            if self._active == version:
                raise ValueError(f"version {version} is active; activate another one first")
            self._loaded.pop(version, None)

    def activate(self, version: int | None) -> None:
        """Make `version` (None = base) what NAME and the aliases serve. It must be loaded."""
        with self._lock:
            if version is not None and version not in self._loaded:
                raise ValueError(f"version {version} is not loaded")
            self._active = version

    def resolve(self, name: str) -> Resolved:
        if name == self.policy or name in self.aliases:
            return Resolved(name, self._active)
        if name == f"{self.policy}@base":
            return Resolved(name, None)
        version = self.pinned(name)
        if version is not None and version in self._loaded:
            return Resolved(name, version)
        raise ModelNotFoundError(name)

    def pinned(self, name: str) -> int | None:
        """N when `name` is `NAME@N` (loaded or not), else None."""
        base, sep, suffix = name.partition("@")
        return parse_version(suffix) if sep and base == self.policy else None

    def model_ids(self) -> list[str]:
        ids = [self.policy, f"{self.policy}@base"]
        ids += [f"{self.policy}@{v}" for v in self.loaded_versions()]
        ids += list(self.aliases)
        return ids

    def model_object(self, model_id: str) -> dict[str, object]:
        self.resolve(model_id)  # raises ModelNotFoundError for unknown ids
        version = parse_version(model_id.partition("@")[2])
        created = self.created if version is None else self._loaded.get(version, self.created)
        return {"id": model_id, "object": "model", "created": created, "owned_by": "rlproxy"}
