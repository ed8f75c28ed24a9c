"""Hot-swap under load: new versions published while clients keep sending requests.

Four client threads send requests (streamed and not) without pause while three adapter versions
appear in the checkpoint folder, each renamed into place the way the trainer writes them. The
server's publisher loads and activates each. No request may fail, and every stored call must
carry a version that was active when the call started. Then a truncated version appears: it is
rejected and the previous one keeps serving.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from tests.e2e.conftest import Server
from tests.e2e.helpers import db_rows, own_server
from tests.e2e.test_adapters import write_random_lora

CLIENTS = 4


@pytest.fixture(scope="module")
def hserver(tmp_path_factory: pytest.TempPathFactory, model_data_dir: Path) -> Iterator[Server]:
    env = {"RLPROXY_PUBLISH_ADAPTERS": "true", "RLPROXY_ADAPTER_POLL_S": "0.5"}
    with own_server(tmp_path_factory.mktemp("hotswap-data"), model_data_dir, env) as server:
        yield server


def _publish(source: Path, root: Path, version: int) -> None:
    """Put a version in place as the trainer does: a temporary folder, then one rename."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{version:04d}-test"
    shutil.copytree(source, tmp)
    os.rename(tmp, root / f"{version:04d}")


def _adapters(server: Server) -> dict[int, dict]:
    data = httpx.get(f"{server.url}/rl/adapters", timeout=30).json()["data"]
    return {a["version"]: a for a in data}


def _wait_status(server: Server, version: int, status: str, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        a = _adapters(server).get(version)
        if a is not None and a["status"] == status:
            return a
        time.sleep(0.3)
    raise AssertionError(f"version {version} never became {status}: {_adapters(server)}")


def test_three_versions_published_under_load_then_a_corrupt_one(
    hserver: Server, model_data_dir: Path, tmp_path: Path
) -> None:
    lora = tmp_path / "lora"
    write_random_lora(model_data_dir, lora)
    root = hserver.data_dir / "checkpoints" / "rlproxy"
    stop = threading.Event()
    failures: list[str] = []
    sent = [0] * CLIENTS

    def client_loop(i: int) -> None:
        with OpenAI(base_url=hserver.base_url, api_key="sk-test", max_retries=0, timeout=120) as c:
            while not stop.is_set():
                try:
                    kwargs = dict(
                        model="rlproxy",
                        messages=[{"role": "user", "content": f"Count to ten. ({i})"}],
                        max_tokens=6,
                        temperature=0.7,
                    )
                    if sent[i] % 2:
                        text = "".join(
                            ch.choices[0].delta.content or ""
                            for ch in c.chat.completions.create(stream=True, **kwargs)  # type: ignore[call-overload]
                            if ch.choices
                        )
                    else:
                        text = c.chat.completions.create(**kwargs).choices[0].message.content  # type: ignore[call-overload]
                    assert text is not None
                except Exception as exc:  # every failure counts, whatever it is
                    failures.append(f"{type(exc).__name__}: {exc}")
                sent[i] += 1

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(CLIENTS)]
    for t in threads:
        t.start()

    def wait_for_requests(count: int, timeout_s: float = 300) -> None:
        target = sum(sent) + count
        deadline = time.monotonic() + timeout_s
        while sum(sent) < target and time.monotonic() < deadline:
            time.sleep(0.2)

    try:
        wait_for_requests(CLIENTS)
        for version in (1, 2, 3):
            _publish(lora, root, version)
            _wait_status(hserver, version, "loaded")
            wait_for_requests(2 * CLIENTS)  # some start on this version before the next swap
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)

    assert failures == []
    adapters = _adapters(hserver)
    assert adapters[3]["active"]
    activations = sorted((adapters[v]["activated_at"], v) for v in (1, 2, 3))

    def active_at(t: float) -> int | None:
        current = None
        for at, v in activations:
            if at <= t:
                current = v
        return current

    calls = db_rows(hserver.data_dir, "SELECT created_at, adapter_version FROM calls")
    assert len(calls) == sum(sent)
    versions_seen = set()
    for call in calls:
        start = call["created_at"]
        possible = {active_at(start + d) for d in (-0.5, -0.25, 0.0, 0.25, 0.5)}
        assert call["adapter_version"] in possible, (call["adapter_version"], start, activations)
        versions_seen.add(call["adapter_version"])
    assert {None, 1, 2, 3} <= versions_seen  # the load really overlapped every swap

    # A truncated version is rejected; version 3 keeps serving.
    bad = tmp_path / "bad"
    shutil.copytree(lora, bad)
    weights = bad / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    _publish(bad, root, 4)
    rejected = _wait_status(hserver, 4, "rejected")
    assert "corrupt" in rejected["error"]
    with OpenAI(base_url=hserver.base_url, api_key="sk-test", max_retries=0, timeout=120) as c:
        raw = c.chat.completions.with_raw_response.create(
            model="rlproxy", messages=[{"role": "user", "content": "Hi"}], max_tokens=3
        )
        rid = raw.headers["x-request-id"]
    (row,) = db_rows(
        hserver.data_dir, "SELECT adapter_version FROM calls WHERE request_id = ?", (rid,)
    )
    assert row["adapter_version"] == 3
    models = httpx.get(f"{hserver.base_url}/models", timeout=30).json()["data"]
    assert "rlproxy@4" not in [m["id"] for m in models]
