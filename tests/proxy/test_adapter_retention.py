"""Adapter versions do not pile up: the active one and `keep_previous` before it stay loaded.

The real embedded model on the real local engine, with real PEFT LoRA folders: 30 versions are
published one after another (as the publisher does, through `AdapterManager.activate`). The
engine must hold at most k+1 adapters at any time and the process's memory must stay flat while
it publishes the last 20 (each version's weights are a few MB; 20 leaked versions would show).
A request in flight on a version that gets unloaded finishes on it; a pinned old version is
loaded again on demand.
"""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch

from proxy.adapters.manager import AdapterManager
from proxy.adapters.registry import ServedModels, adapter_name
from proxy.engines.base import ChoiceFinished, GenerationRequest, SamplingParams
from proxy.engines.local import LocalEngine
from tests.e2e.test_adapters import write_random_lora

pytestmark = pytest.mark.asyncio(loop_scope="function")

VERSIONS = 30
KEEP = 2


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


@pytest.fixture(scope="module")
def lora(tmp_path_factory: pytest.TempPathFactory, model_data_dir: Path) -> Path:
    path = tmp_path_factory.mktemp("lora") / "adapter"
    write_random_lora(model_data_dir, path)
    return path


@pytest_asyncio.fixture(loop_scope="function")
async def engine(model_data_dir: Path) -> AsyncIterator[LocalEngine]:
    from proxy.engines.loader import load_model

    # Its own model object: PEFT wraps the model it loads adapters into.
    engine = LocalEngine(load_model(model_data_dir, device=torch.device("cpu")))
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


def _publish(lora: Path, root: Path, version: int) -> None:
    shutil.copytree(lora, root / f"{version:04d}")


def _engine_adapters(engine: LocalEngine) -> list[str]:
    return list(engine.health().detail["adapters"])


async def test_thirty_versions_keep_k_plus_one_loaded_and_memory_flat(
    engine: LocalEngine, lora: Path, tmp_path: Path
) -> None:
    registry = ServedModels("rlproxy")
    manager = AdapterManager(engine, registry, tmp_path, keep_previous=KEEP)
    most_loaded = 0
    rss: dict[int, float] = {}
    for version in range(1, VERSIONS + 1):
        _publish(lora, tmp_path, version)
        await manager.activate(version)
        assert registry.active == version
        most_loaded = max(most_loaded, len(_engine_adapters(engine)))
        if version in (10, VERSIONS):
            rss[version] = _rss_mb()

    assert most_loaded == KEEP + 1
    assert registry.loaded_versions() == [VERSIONS - 2, VERSIONS - 1, VERSIONS]
    assert sorted(_engine_adapters(engine)) == sorted(
        adapter_name(v) for v in registry.loaded_versions()
    )
    one_version_mb = (lora / "adapter_model.safetensors").stat().st_size / 2**20
    leaked_if_kept = (VERSIONS - 10) * one_version_mb
    grown = rss[VERSIONS] - rss[10]
    assert grown < leaked_if_kept / 2, (
        f"RSS grew {grown:.1f} MB over the last {VERSIONS - 10} versions "
        f"({one_version_mb:.1f} MB each)"
    )

    # Rolling back to a kept version needs no load; to an unloaded one, one load.
    await manager.activate(VERSIONS - 1)
    assert registry.active == VERSIONS - 1
    await manager.activate(3)
    assert registry.active == 3
    assert set(registry.loaded_versions()) == {3, VERSIONS - 1, VERSIONS}


async def test_a_request_in_flight_finishes_on_a_version_being_unloaded(
    engine: LocalEngine, lora: Path, tmp_path: Path
) -> None:
    registry = ServedModels("rlproxy")
    manager = AdapterManager(engine, registry, tmp_path, keep_previous=0)
    _publish(lora, tmp_path, 1)
    await manager.activate(1)
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=0)
    request = GenerationRequest(prompt_ids=[1, 2, 3], params=params, adapter=adapter_name(1))
    stream = engine.generate(request)
    first = await anext(stream)  # decoding on version 1 has begun
    assert first.index == 0

    _publish(lora, tmp_path, 2)
    await manager.activate(2)  # version 1 is no longer kept: unloaded once the request is done
    assert registry.loaded_versions() == [2]
    assert adapter_name(1) in _engine_adapters(engine)  # still decoding on it

    events = [event async for event in stream]
    finished = [e for e in events if isinstance(e, ChoiceFinished)]
    assert [(f.finish_reason, f.adapter) for f in finished] == [("length", adapter_name(1))]
    assert len(finished[0].completion_token_ids) == 40
    await _settled(engine, [adapter_name(2)])


async def test_a_pinned_old_version_is_loaded_on_demand(
    engine: LocalEngine, lora: Path, tmp_path: Path
) -> None:
    registry = ServedModels("rlproxy")
    manager = AdapterManager(engine, registry, tmp_path, keep_previous=0)
    for version in (1, 2, 3):
        _publish(lora, tmp_path, version)
        await manager.activate(version)
    assert registry.loaded_versions() == [3]
    await manager.ensure_servable("rlproxy@1")
    assert registry.resolve("rlproxy@1").version == 1
    await manager.ensure_servable("rlproxy@7")  # not on disk: left to resolve's 404
    assert registry.loaded_versions() == [1, 3]
    _publish(lora, tmp_path, 4)
    await manager.activate(4)  # the on-demand version goes at the next activation
    assert registry.loaded_versions() == [4]


async def _settled(engine: LocalEngine, expected: list[str]) -> None:
    import asyncio

    for _ in range(50):  # the worker frees pending unloads between steps (at most 0.5 s apart)
        if sorted(_engine_adapters(engine)) == sorted(expected):
            return
        await asyncio.sleep(0.1)
    assert sorted(_engine_adapters(engine)) == sorted(expected)
