"""The served-model registry: which names the proxy answers to and which adapter each one means.

    NAME          the policy: the newest active adapter version (the base while there is none)
    NAME@base     the base model, no adapter
    NAME@N        adapter version N, pinned (while it is loaded)
    alias         configured other names (e.g. `gpt-4o-mini`) that mean NAME
    a pattern     on one protocol only, names matching a glob that mean NAME: on Anthropic's
                  Messages API `claude-*` (RLPROXY_MESSAGES_MODEL_PATTERNS), the names Claude
                  Code and other Anthropic clients send by default

During a canary rollout (`proxy.adapters.rollout`) NAME and the aliases mean one of two
versions per call: the canary for a share of the traffic, the active version for the rest
(`route`). Which one is a stable hash of the conversation (`canary_draw`: blake2b of its key,
keyed by the policy and the canary's version), so every replica, before and after a restart,
sends a conversation to the same version. A conversation's key is its explicit trajectory id,
else its opening up to the first answer (`conversation_key`, hashed as the trajectory linker
hashes it); a first turn without an id has no key yet and draws at
random, and the replica that served it keeps the conversation on that draw (`StickyRoutes`);
on another replica its later turns follow the hash (send a trajectory id to have every turn
agree everywhere). Pins (`NAME@N`, `NAME@base`) are never split.

A task held out of training for the evaluation (`storage.held_out`) draws an arm once, by a
stable hash of the task: its "base" arm's calls for NAME get the base model, before any canary
draw (the control the evaluation compares versions with); its "policy" arm is routed as above.

The rollout's watch (`proxy.adapters.rollout`, `watch_share`): while a trained version is
active, conversations the canary did not draw draw once more (`canary_draw` keyed by the
policy and version 0, which no canary is), and `watch_share` of them get the base model, the
control the active version is watched against. Kept per conversation like the canary's draw.

Whatever name a call asked for, its answer names the version that served it, `NAME@N` or
`NAME@base` (`version_id`), as OpenAI's answer to an alias names the snapshot it resolved to.

The registry only maps names to versions; loading weights is the engine's job, and the
`AdapterManager` (`manager.py`) changes the registry only after an engine load succeeded.
"""

from __future__ import annotations

import hashlib
import random
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

from proxy.errors import ModelNotFoundError
from storage.held_out import Arm
from storage.linking import opening_hash


def parse_version(suffix: str) -> int | None:
    """The N of `NAME@N`: ASCII digits only, at most nine of them; None for anything else."""
    if 0 < len(suffix) <= 9 and suffix.isascii() and suffix.isdigit():
        return int(suffix)
    return None


def version_label(version: int | None) -> str:
    """Version N as it follows `NAME@` and as `X-RLProxy-Version` says it: `N`, or `base` for
    the base model (None)."""
    return "base" if version is None else str(version)


def version_id(policy: str, version: int | None) -> str:
    """The served name of `version` (None: the base) of `policy`, `NAME@N` or `NAME@base`: how
    `GET /v1/models` lists it, and the `model` every answer it served names."""
    return f"{policy}@{version_label(version)}"


def adapter_name(version: int) -> str:
    """The engine-side name of adapter version N."""
    return f"v{version}"


@dataclass(frozen=True)
class Resolved:
    """What a requested model name serves: `version` None means the base model.
    `follows_policy`: the name means NAME (the policy, an alias or a pattern), not a pin; a
    canary splits its traffic."""

    requested: str
    version: int | None
    follows_policy: bool = False

    @property
    def adapter(self) -> str | None:
        return None if self.version is None else adapter_name(self.version)


def conversation_key(
    messages: list[dict[str, Any]], trajectory_id: str | None = None
) -> str | None:
    """What stays the same on every turn of one conversation: an explicit trajectory id, else
    its opening up to and including the first answer (`storage.linking.opening_hash`, the
    trajectory linker's canonical chain, so a conversation the store links as one draws as
    one). None for a first turn that has no answer yet: it draws, and `remember` keys its
    answer."""
    if trajectory_id:
        return f"t:{trajectory_id}"
    opening = opening_hash(messages)
    return None if opening is None else f"m:{opening}"


def canary_draw(key: str, policy: str, canary_version: int) -> float:
    """Where conversation `key` falls in [0, 1) for this canary: the same on every replica and
    across restarts; a new canary version draws a new, independent split."""
    secret = f"{policy}@{canary_version}".encode()
    if len(secret) > 64:  # blake2b's key is at most 64 bytes: a long name is hashed down whole
        secret = hashlib.blake2b(secret).digest()  # (cutting it would drop the version)
    digest = hashlib.blake2b(key.encode(), digest_size=8, key=secret).digest()
    return int.from_bytes(digest, "big") / 2.0**64


class StickyRoutes:
    """Which version a conversation drew, by a key of its opening (bounded, oldest forgotten).

    In memory only: it matters for conversations whose first turn drew at random (no trajectory
    id); after a restart, or on another replica, their later turns follow the stable hash."""

    def __init__(self, capacity: int = 100_000) -> None:
        self.capacity = capacity
        self._routes: OrderedDict[str, int | None] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> tuple[bool, int | None]:
        with self._lock:
            if key not in self._routes:
                return False, None
            self._routes.move_to_end(key)
            return True, self._routes[key]

    def put(self, key: str, version: int | None) -> None:
        with self._lock:
            self._routes[key] = version
            self._routes.move_to_end(key)
            while len(self._routes) > self.capacity:
                self._routes.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._routes.clear()

    def __len__(self) -> int:
        return len(self._routes)


@dataclass(frozen=True)
class Canary:
    """A version on trial: it serves `share` of the policy name's traffic."""

    version: int
    share: float


@dataclass
class ServedModels:
    policy: str
    aliases: tuple[str, ...] = ()
    base_model: str | None = None
    """The base model's name (RLPROXY_BASE_MODEL as given), each entry's `root` as in vLLM."""
    patterns: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Protocol -> globs of further names that mean NAME on that protocol only (case-sensitive,
    `fnmatch`): `{"messages": ("claude-*",)}`. Not listed by `GET /v1/models`."""
    created: int = field(default_factory=lambda: int(time.time()))
    _loaded: dict[int, int] = field(default_factory=dict)  # version -> loaded-at time
    _active: int | None = None
    _canary: Canary | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    sticky: StickyRoutes = field(default_factory=StickyRoutes)
    rng: random.Random = field(default_factory=random.Random)
    watch_share: float = 0.0
    """While a trained version is active, the share of NAME's other conversations the base
    model answers: the rollout's watch compares the two (0: no watch)."""

    @property
    def active(self) -> int | None:
        return self._active

    def loaded_versions(self) -> list[int]:
        return sorted(self._loaded)

    def add_version(self, version: int) -> None:
        with self._lock:
            self._loaded.setdefault(version, int(time.time()))

    @property
    def canary(self) -> Canary | None:
        return self._canary

    @property
    def splits(self) -> bool:
        """Whether NAME means more than one version per call now: a canary runs, or the watch
        sends a share to the base (`route` decides which)."""
        return self._canary is not None or (self.watch_share > 0.0 and self._active is not None)

    def remove_version(self, version: int) -> None:
        with self._lock:
            if self._active == version:
                raise ValueError(f"version {version} is active; activate another one first")
            if self._canary is not None and self._canary.version == version:
                raise ValueError(f"version {version} is on canary; end the canary first")
            self._loaded.pop(version, None)

    def activate(self, version: int | None) -> None:
        """Make `version` (None = base) what NAME and the aliases serve. It must be loaded.
        A canary ends: promoted if it is `version`, otherwise its comparison (against the
        version active until now) no longer holds."""
        with self._lock:
            if version is not None and version not in self._loaded:
                raise ValueError(f"version {version} is not loaded")
            self._active = version
            if self._canary is not None:
                self._canary = None
                self.sticky.clear()

    def start_canary(self, version: int, share: float) -> None:
        """Serve the loaded `version` to `share` (0 < share < 1) of NAME's conversations."""
        if not 0.0 < share < 1.0:
            raise ValueError(f"a canary's share must be between 0 and 1, not {share}")
        with self._lock:
            if version not in self._loaded:
                raise ValueError(f"version {version} is not loaded")
            if version == self._active:
                raise ValueError(f"version {version} is already active")
            self._canary = Canary(version, share)
            self.sticky.clear()

    def pause_canary(self) -> None:
        """The canary takes no new conversations (its share becomes 0); those already on it
        stay on it. Its rollout has spent its call budget and waits for their evidence."""
        with self._lock:
            if self._canary is not None:
                self._canary = Canary(self._canary.version, 0.0)

    def end_canary(self) -> None:
        """NAME serves the active version alone again."""
        with self._lock:
            self._canary = None
            self.sticky.clear()

    def route(
        self, resolved: Resolved, key: str | None = None, *, held_out: Arm | None = None
    ) -> Resolved:
        """The version this call gets: `resolved` unchanged unless it names the policy. Then a
        held-out task's base arm (`held_out` "base", `storage.held_out`) gets the base model, the
        evaluation's control; otherwise, while a canary runs or the watch is on, the version
        `key`'s conversation drew before, else a fresh draw (the canary when `key`'s stable draw
        falls under its share; else the base when the watch's draw falls under `watch_share`;
        else the active version; without a key at random), remembered under `key`."""
        if not resolved.follows_policy:
            return resolved
        if held_out == "base":
            return Resolved(resolved.requested, None, follows_policy=True)
        canary, active = self._canary, self._active
        watch = self.watch_share if active is not None else 0.0
        if canary is None and watch <= 0.0:
            return resolved
        if key is not None:
            known, version = self.sticky.get(key)
            kept = (
                version == active
                or (canary is not None and version == canary.version)
                or (version is None and watch > 0.0)
            )
            if known and kept:
                return Resolved(resolved.requested, version, follows_policy=True)
        version = active
        if canary is not None:
            draw = (
                self.rng.random() if key is None else canary_draw(key, self.policy, canary.version)
            )
            if draw < canary.share:
                version = canary.version
        if version == active and watch > 0.0:
            draw = self.rng.random() if key is None else canary_draw(key, self.policy, 0)
            if draw < watch:
                version = None
        if key is not None:
            self.sticky.put(key, version)
        return Resolved(resolved.requested, version, follows_policy=True)

    def remember(self, key: str, version: int | None) -> None:
        """Keep a conversation on `version` (while a canary runs or the watch is on; otherwise
        nothing to keep)."""
        if self.splits:
            self.sticky.put(key, version)

    def resolve(self, name: str, *, protocol: str = "chat") -> Resolved:
        """What `name` serves when a request of `protocol` ("chat", "responses", "messages")
        asks for it. Raises `ModelNotFoundError` (404) for a name this server does not serve."""
        if name == self.policy or name in self.aliases or self._matches(name, protocol):
            return Resolved(name, self._active, follows_policy=True)
        if name == f"{self.policy}@base":
            return Resolved(name, None)
        version = self.pinned(name)
        if version is not None and version in self._loaded:
            return Resolved(name, version)
        raise ModelNotFoundError(name)

    def _matches(self, name: str, protocol: str) -> bool:
        return any(fnmatchcase(name, p) for p in self.patterns.get(protocol, ()))

    def pinned(self, name: str) -> int | None:
        """N when `name` is `NAME@N` (loaded or not), else None."""
        base, sep, suffix = name.partition("@")
        return parse_version(suffix) if sep and base == self.policy else None

    def version_id(self, version: int | None) -> str:
        """The policy's served name of `version` (module `version_id`)."""
        return version_id(self.policy, version)

    def model_ids(self) -> list[str]:
        ids = [self.policy, self.version_id(None)]
        ids += [self.version_id(v) for v in self.loaded_versions()]
        ids += list(self.aliases)
        return ids

    def model_object(self, model_id: str) -> dict[str, object]:
        self.resolve(model_id)  # raises ModelNotFoundError for unknown ids
        version = parse_version(model_id.partition("@")[2])
        created = self.created if version is None else self._loaded.get(version, self.created)
        entry: dict[str, object] = {
            "id": model_id,
            "object": "model",
            "created": created,
            "owned_by": "rlproxy",
        }
        if (
            self.base_model is not None
        ):  # vLLM's ModelCard: the base in `root`, a LoRA's in `parent`
            entry["root"] = self.base_model
            entry["parent"] = f"{self.policy}@base" if version is not None else None
        return entry
