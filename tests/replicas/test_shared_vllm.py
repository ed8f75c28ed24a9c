"""Two `rlproxy serve` replicas on one Postgres database in front of ONE vLLM-protocol server:
no replica unloads a version the other still serves.

The vLLM is the stand-in (`tests/fakes/vllm_server.py`: vLLM's LoRA routes and answers, with the
embedded model); a real vLLM (tests/vllm_real) takes minutes to start on CPU, too slow for this.
Replica "a" keeps no previous version loaded (`RLPROXY_KEEP_ADAPTERS=0`), replica "b" keeps
two. Versions 1, 2, 3 are published one after the other: "a" wants only 3 loaded, but 1 and 2
stay on the shared server because "b" keeps them (its heartbeat says so), and a client pinning
`rlproxy@1` on "b" is served by version 1. Once "b" stops (its heartbeat gone), "a" unloads them.

Marker `scale` (`make test-scale`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.helpers import wait_for
from tests.e2e.test_adapters import write_random_lora
from tests.e2e.test_hotswap import _publish
from tests.fakes.stack import FakeReplica, start_replicas
from tests.replicas.cluster import Cluster, cluster

pytestmark = pytest.mark.scale


@pytest.fixture(scope="module")
def shared(
    tmp_path_factory: pytest.TempPathFactory, model_data_dir: Path
) -> Iterator[tuple[Cluster, FakeReplica, Path]]:
    work = tmp_path_factory.mktemp("shared-vllm")
    lora = work / "lora"
    write_random_lora(model_data_dir, lora)
    (vllm,) = start_replicas(work / "vllm", model_data_dir, 1)
    try:
        vllm.wait()
        env = {
            "RLPROXY_ENGINE": "vllm",
            "RLPROXY_VLLM_URLS": json.dumps([vllm.url]),
            "RLPROXY_VLLM_HEALTH_INTERVAL_S": "0.5",
            "RLPROXY_PUBLISH_ADAPTERS": "true",
            "RLPROXY_ROLLOUT": "false",  # each version serves at once (the guard: test_rollout.py)
            "RLPROXY_ADAPTER_POLL_S": "0.5",
            "RLPROXY_LEASE_S": "3",
        }
        per_replica = {"a": {"RLPROXY_KEEP_ADAPTERS": "0"}, "b": {"RLPROXY_KEEP_ADAPTERS": "2"}}
        with cluster(work, model_data_dir, ["a", "b"], env, per_replica) as c:
            yield c, vllm, lora
    finally:
        vllm.stop()


def _on_vllm(vllm: FakeReplica) -> set[str]:
    cards = httpx.get(f"{vllm.url}/v1/models", timeout=30).json()["data"]
    return {c["id"] for c in cards if c.get("parent")}


def _active(url: str) -> int | None:
    data: list[dict[str, Any]] = httpx.get(f"{url}/rl/adapters", timeout=30).json()["data"]
    return next((int(v["version"]) for v in data if v["active"]), None)


def test_a_version_another_replica_keeps_stays_loaded_on_the_shared_vllm(
    shared: tuple[Cluster, FakeReplica, Path],
) -> None:
    c, vllm, lora = shared
    a, b = c.replicas["a"], c.replicas["b"]
    for version in (1, 2, 3):
        _publish(lora, c.checkpoints / "rlproxy", version)
        for replica in (a, b):
            wait_for(
                lambda r=replica, v=version: _active(r.url) == v,
                60,
                f"replica {replica.name} serving version {version}",
                poll_s=0.2,
            )
    # Both have polled since version 3 (they follow it): "a" has tried to unload 1 and 2.
    wait_for(
        lambda: (
            {r["id"]: json.loads(r["versions"]) for r in c.rows("SELECT * FROM replicas")}
            == {"a": [3], "b": [1, 2, 3]}
        ),
        30,
        "both heartbeats after version 3",
        poll_s=0.2,
    )
    assert _on_vllm(vllm) == {"rlproxy@1", "rlproxy@2", "rlproxy@3"}
    body = {
        "model": "rlproxy@1",
        "messages": [{"role": "user", "content": "Say a colour."}],
        "max_tokens": 2,
    }
    r = httpx.post(f"{b.url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    rows = c.rows("SELECT adapter_version FROM calls WHERE completion_id = $1", r.json()["id"])
    assert [row["adapter_version"] for row in rows] == [1]
    # "a" refuses to unload by hand what "b" still serves, with a clear error.
    refused = httpx.post(f"{a.url}/rl/adapters/1/unload", timeout=30)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "adapter_in_use"

    c.stop("b")  # a clean stop removes its heartbeat: nobody else needs 1 and 2
    wait_for(
        lambda: _on_vllm(vllm) == {"rlproxy@3"},
        30,
        "replica a unloading what no replica serves any more",
        poll_s=0.2,
    )
