"""Two rlproxy replicas' vllm engines in front of ONE vLLM-protocol server (the stand-in,
`tests/fakes/vllm_server.py`, a real process), coordinated through one database as serve does
it (`SharedVersions`: heartbeats listing the versions each replica keeps): when the vLLM comes
back (restarted), one replica's rejoin never unloads a LoRA the other still serves.

Replica "a" retired version 1 earlier (unloaded it when nobody needed it); replica "b" then
loaded it again (a client pinned `rlproxy@1`) and keeps it. The vLLM restarts, "b" rejoins
first and loads 1 and 2 on it, then "a" rejoins: it must leave `rlproxy@1` there, and "b" still
generates on version 1. With one replica, a version it retired while the vLLM was out of its
rotation is still unloaded when the vLLM rejoins (nobody else keeps it).

The health checks are driven by the test (`pool.check_all()`, the engines' own watch waits an
hour), so which replica rejoins first is the test's choice, not the clock's.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from proxy.adapters.deployment import SharedVersions
from proxy.engines.base import ChoiceFinished, GenerationRequest, SamplingParams
from proxy.engines.vllm import VLLMEngine
from storage import Store
from tests.e2e.test_adapters import write_random_lora
from tests.fakes.stack import FakeReplica, start_replicas
from tests.fakes.vllm_wire import FakeTokenizer

pytestmark = pytest.mark.asyncio(loop_scope="function")


@pytest.fixture(scope="module")
def lora(tmp_path_factory: pytest.TempPathFactory, model_data_dir: Path) -> Path:
    folder = tmp_path_factory.mktemp("lora") / "lora"
    write_random_lora(model_data_dir, folder)
    return folder


@pytest.fixture(scope="module")
def vllm(tmp_path_factory: pytest.TempPathFactory, model_data_dir: Path) -> Iterator[FakeReplica]:
    (replica,) = start_replicas(tmp_path_factory.mktemp("shared-vllm"), model_data_dir, 1)
    try:
        replica.wait()
        yield replica
    finally:
        replica.stop()


async def engine_of(vllm: FakeReplica, shared: SharedVersions) -> VLLMEngine:
    """One replica's engine as serve builds it: told which adapters other replicas keep."""
    engine = VLLMEngine(
        [vllm.url],
        FakeTokenizer(),
        policy="rlproxy",
        health_interval_s=3600,  # the test probes (pool.check_all), in the order it chooses
        needed_elsewhere=shared.adapters_needed_elsewhere,
    )
    await engine.start()
    return engine


def on_vllm(vllm: FakeReplica) -> set[str]:
    cards = httpx.get(f"{vllm.url}/v1/models", timeout=30).json()["data"]
    return {c["id"] for c in cards if c.get("parent")}


async def generate(engine: VLLMEngine, adapter: str) -> ChoiceFinished:
    request = GenerationRequest([1, 2, 3], SamplingParams(max_tokens=2), adapter=adapter)
    events = [event async for event in engine.generate(request)]
    assert isinstance(events[-1], ChoiceFinished)
    return events[-1]


async def test_a_rejoin_keeps_a_lora_another_replica_serves(
    vllm: FakeReplica, lora: Path, store: Store
) -> None:
    a_shared = SharedVersions(store, "rlproxy", "a", stale_s=60)
    b_shared = SharedVersions(store, "rlproxy", "b", stale_s=60)
    a = await engine_of(vllm, a_shared)
    b = await engine_of(vllm, b_shared)
    try:
        await a.load_adapter("v1", str(lora))
        await a.load_adapter("v2", str(lora))
        await a_shared.heartbeat([2])  # "a" moved on to version 2 and retired 1:
        await a.unload_adapter("v1")  # nobody kept it, so it left the vLLM
        assert on_vllm(vllm) == {"rlproxy@2"}

        await b.load_adapter("v2", str(lora))
        await b.load_adapter("v1", str(lora))  # "b": a client pinned rlproxy@1
        await b_shared.heartbeat([1, 2])
        assert on_vllm(vllm) == {"rlproxy@1", "rlproxy@2"}

        vllm.kill()  # the vLLM restarts: both replicas see it gone, it comes back empty
        await b.pool.check_all()
        await a.pool.check_all()
        assert not b.pool.healthy() and not a.pool.healthy()
        vllm.start()
        vllm.wait()
        await b.pool.check_all()  # "b" rejoins first: loads 1 and 2 again
        assert on_vllm(vllm) == {"rlproxy@1", "rlproxy@2"}
        await a.pool.check_all()  # then "a", which once retired rlproxy@1
        assert a.pool.healthy() and b.pool.healthy()

        finished = await generate(b, "v1")  # b's clients on version 1 are still served
        assert finished.adapter == "v1" and len(finished.completion_token_ids) >= 1
        assert b.pool.healthy()  # there, not refused as a lost adapter
        assert on_vllm(vllm) == {"rlproxy@1", "rlproxy@2"}
        assert a.health().detail["replicas"][0]["adapters"] == ["rlproxy@2"]  # not a's
    finally:
        await a.stop()
        await b.stop()


async def test_with_one_replica_a_rejoin_still_unloads_what_it_retired(
    vllm: FakeReplica, lora: Path, store: Store
) -> None:
    shared = SharedVersions(store, "rlproxy", "a", stale_s=60)
    a = await engine_of(vllm, shared)
    try:
        for lora_name in on_vllm(vllm):  # left by the test before: this vLLM is a's alone now
            httpx.post(f"{vllm.url}/v1/unload_lora_adapter", json={"lora_name": lora_name})
        await a.load_adapter("v1", str(lora))
        await a.load_adapter("v2", str(lora))
        await shared.heartbeat([2])
        replica = a.pool.replicas[0]
        a.pool.mark_down(replica, "a probe timed out")  # out of a's rotation, still running
        await a.unload_adapter("v1")  # so it stays on the vLLM for now
        assert on_vllm(vllm) == {"rlproxy@1", "rlproxy@2"}
        await a.pool.check_all()  # back: what a retired meanwhile and nobody keeps goes
        assert a.pool.healthy()
        assert on_vllm(vllm) == {"rlproxy@2"}
        assert (await generate(a, "v2")).adapter == "v2"
    finally:
        await a.stop()
