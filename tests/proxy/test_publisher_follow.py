"""Publishers of two replicas on one database (one SQLite file), each with its own registry: one
holds the publisher lease and publishes, both follow the policy's state; an activation through
either holds on both; a new lease holder does not publish again what a hand rolled back; a
database from before the policy's state serves its last active version again.

The engine is a stand-in that records loads and unloads (this is about which version each
replica serves, not about weights: tests/replicas/ runs real servers); the adapter folders are
real, small PEFT-shaped files that pass serving's validation.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from proxy.adapters.deployment import SharedVersions
from proxy.adapters.manager import AdapterManager
from proxy.adapters.publisher import Publisher
from proxy.adapters.registry import ServedModels
from storage import Store
from storage.records import AdapterRecord

pytestmark = pytest.mark.asyncio(loop_scope="function")


class RecordingEngine:
    def __init__(self) -> None:
        self.loaded: set[str] = set()
        self.unloads: list[str] = []

    async def load_adapter(self, name: str, path: str) -> None:
        self.loaded.add(name)

    async def unload_adapter(self, name: str) -> None:
        self.loaded.discard(name)
        self.unloads.append(name)


def _write_version(root: Path, version: int) -> None:
    folder = root / f"{version:04d}"
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": 8}))
    save_file({"lora_A": torch.zeros(2, 2)}, str(folder / "adapter_model.safetensors"))


def _replica(
    store: Store, root: Path, name: str, *, keep: int = 2, shared: bool = False
) -> tuple[Publisher, AdapterManager, RecordingEngine]:
    engine = RecordingEngine()
    versions = SharedVersions(store, "rlproxy", name, stale_s=60)
    manager = AdapterManager(
        engine,  # type: ignore[arg-type]
        ServedModels("rlproxy"),
        root,
        keep_previous=keep,
        shared=versions if shared else None,
    )
    publisher = Publisher(manager, store, replica_id=name, lease_s=60, shared=versions)
    return publisher, manager, engine


async def test_one_publishes_both_follow_and_activations_hold_everywhere(
    store: Store, tmp_path: Path
) -> None:
    root = tmp_path / "checkpoints" / "rlproxy"
    _write_version(root, 1)
    a, ma, _ = _replica(store, root, "a")
    b, mb, _ = _replica(store, root, "b")
    assert await a.check() == 1  # a takes the publisher lease and publishes
    assert await b.check() is None  # b does not hold it: it follows
    assert (ma.registry.active, mb.registry.active) == (1, 1)
    _write_version(root, 2)
    assert await b.check() is None and mb.registry.active == 1  # b never publishes
    assert await a.check() == 2
    await b.check()
    assert mb.registry.active == 2
    # a rollback by hand through b: b serves 1 at once, a after its next poll
    await mb.activate(1)
    await b.note_activation(1)
    await a.check()
    assert (ma.registry.active, mb.registry.active) == (1, 1)
    # a stops cleanly: b takes the lease over and does not publish 2 again
    await a.leave()
    assert await b.check() is None
    lease = await store.get_lease("publisher:rlproxy")
    assert lease is not None and lease.holder == "b"
    assert mb.registry.active == 1
    # the base model, through b; a follows
    await mb.activate(None)
    await b.note_activation(None)
    a2, ma2, _ = _replica(store, root, "a2")  # a restarted: a new replica id
    await a2.check()
    assert ma2.registry.active is None
    state = await store.get_policy_state("rlproxy")
    assert state is not None and (state.active_version, state.changed_by) == (0, "b")


async def test_a_database_from_before_the_policy_state_serves_its_last_active_version(
    store: Store, tmp_path: Path
) -> None:
    root = tmp_path / "checkpoints" / "rlproxy"
    now = time.time()
    for version in (1, 2, 3):
        _write_version(root, version)
        await store.record_adapter(
            AdapterRecord(
                policy="rlproxy",
                version=version,
                path=str(root / f"{version:04d}"),
                status="loaded",
                created_at=now,
                updated_at=now,
                activated_at=now + version,
            )
        )
    publisher, manager, _ = _replica(store, root, "a")
    assert await publisher.check() is None
    assert manager.registry.active == 3
    state = await store.get_policy_state("rlproxy")
    assert state is not None and state.active_version == 3


async def test_on_a_shared_engine_a_version_another_replica_keeps_is_not_unloaded(
    store: Store, tmp_path: Path
) -> None:
    root = tmp_path / "checkpoints" / "rlproxy"
    a, ma, engine_a = _replica(store, root, "a", keep=0, shared=True)
    b, mb, _ = _replica(store, root, "b", keep=2, shared=True)
    for version in (1, 2, 3):
        _write_version(root, version)
        await a.check()
        await b.check()
    await a.check()  # after b's heartbeat says it keeps 1, 2, 3
    assert ma.registry.active == mb.registry.active == 3
    assert engine_a.unloads == []
    assert sorted(ma.registry.loaded_versions()) == [1, 2, 3]
    await b.leave()  # b's heartbeat is gone: nobody keeps 1 and 2 any more
    await a.check()
    assert sorted(engine_a.unloads) == ["v1", "v2"]
    assert ma.registry.loaded_versions() == [3]


async def test_on_a_shared_engine_a_version_pinned_here_is_not_unloaded_by_another(
    store: Store, tmp_path: Path
) -> None:
    """A pinned `NAME@N` loaded on demand is listed in this replica's heartbeat at once (not at
    its next poll), so another replica that has it loaded too does not unload it meanwhile; once
    both have evicted since, neither lists it and it is unloaded."""
    root = tmp_path / "checkpoints" / "rlproxy"
    a, ma, engine_a = _replica(store, root, "a", keep=0, shared=True)
    b, mb, engine_b = _replica(store, root, "b", keep=0, shared=True)
    for version in (1, 2):
        _write_version(root, version)
    for _ in range(3):
        await a.check()
        await b.check()
    assert ma.registry.active == mb.registry.active == 2
    assert ma.registry.loaded_versions() == mb.registry.loaded_versions() == [2]
    await ma.ensure_servable("rlproxy@1")  # clients pin version 1 on both replicas
    await mb.ensure_servable("rlproxy@1")
    replicas = {r.id: r for r in await store.live_replicas("rlproxy", 0)}
    assert replicas["b"].versions == (1, 2)
    assert await ma.evict() == []  # a is done with 1; b still serves it: it stays loaded
    assert "v1" not in engine_a.unloads and 1 in ma.registry.loaded_versions()
    for _ in range(2):  # b is done with it too: no one lists it, and it goes
        await b.check()
        await mb.evict()
        await a.check()
    assert "v1" in engine_a.unloads and "v1" in engine_b.unloads
