"""Hot-swap under load: new versions published while clients keep sending requests.

Four client threads send requests (on the three protocols, streamed and not) without pause while
three adapter versions appear in the checkpoint folder, each renamed into place the way the
trainer writes them. The server's publisher loads and activates each. No request may fail, every
stored call must carry a version that was active when the call started, and every answer must
name the version stored on its call (`model`, `X-RLProxy-Version`), not one that became active
while it was generated. Then a truncated version appears: it is rejected and the previous one
keeps serving.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import anthropic
import httpx
import pytest
from openai import OpenAI

from tests.e2e.conftest import Server
from tests.e2e.helpers import db_rows, own_server
from tests.e2e.test_adapters import write_random_lora

CLIENTS = 4
ASKS = 6  # the three protocols, each streamed and not


@dataclass(frozen=True)
class Answered:
    """What one answer said about the version that served it."""

    request_id: str
    header: str  # X-RLProxy-Version
    models: frozenset[str]  # every `model` it named: the body's, or each chunk's or event's


@pytest.fixture(scope="module")
def hserver(tmp_path_factory: pytest.TempPathFactory, model_data_dir: Path) -> Iterator[Server]:
    env = {
        "RLPROXY_PUBLISH_ADAPTERS": "true",
        "RLPROXY_ROLLOUT": "false",  # each version serves at once (the guard: test_rollout.py)
        "RLPROXY_ADAPTER_POLL_S": "0.5",
        # The tests' random LoRA is word salad by the forgetting check's measure: it would be
        # held. This suite is about swapping versions under load; the check's: test_forgetting.py.
        "RLPROXY_FORGETTING_CHECK": "false",
    }
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


def _ask(c: OpenAI, a: anthropic.Anthropic, prompt: str, kind: int) -> Answered:
    """One request for the policy's name: kind 0-5 is Chat Completions, the Responses API or
    Anthropic's Messages, each non-streamed then streamed."""
    stream = bool(kind % 2)
    if kind // 2 == 0:
        messages = [{"role": "user", "content": prompt}]
        raw = c.chat.completions.with_raw_response.create(
            model="rlproxy", messages=messages, max_tokens=6, temperature=0.7, stream=stream
        )
        answer = raw.parse()
        models = {ch.model for ch in answer} if stream else {answer.model}
    elif kind // 2 == 1:
        raw = c.responses.with_raw_response.create(
            model="rlproxy", input=prompt, max_output_tokens=6, temperature=0.7, stream=stream
        )
        answer = raw.parse()
        models = (
            {e.response.model for e in answer if hasattr(e, "response")}
            if stream
            else {answer.model}
        )
    else:
        messages = [{"role": "user", "content": prompt}]
        raw = a.messages.with_raw_response.create(
            model="rlproxy", messages=messages, max_tokens=6, stream=stream
        )
        answer = raw.parse()
        models = (
            {e.message.model for e in answer if e.type == "message_start"}
            if stream
            else {answer.model}
        )
    return Answered(
        raw.headers["x-request-id"], raw.headers["x-rlproxy-version"], frozenset(models)
    )


def test_three_versions_published_under_load_then_a_corrupt_one(
    hserver: Server, model_data_dir: Path, tmp_path: Path
) -> None:
    lora = tmp_path / "lora"
    write_random_lora(model_data_dir, lora)
    root = hserver.data_dir / "checkpoints" / "rlproxy"
    stop = threading.Event()
    failures: list[str] = []
    sent = [0] * CLIENTS
    answers: list[Answered] = []

    def client_loop(i: int) -> None:
        with (
            OpenAI(base_url=hserver.base_url, api_key="sk-test", max_retries=0, timeout=120) as c,
            anthropic.Anthropic(
                base_url=hserver.url, api_key="sk-test", max_retries=0, timeout=120
            ) as a,
        ):
            while not stop.is_set():
                try:
                    answers.append(_ask(c, a, f"Count to ten. ({i})", sent[i] % ASKS))
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

    calls = db_rows(hserver.data_dir, "SELECT request_id, created_at, adapter_version FROM calls")
    assert len(calls) == sum(sent)
    versions_seen = set()
    for call in calls:
        start = call["created_at"]
        possible = {active_at(start + d) for d in (-0.5, -0.25, 0.0, 0.25, 0.5)}
        assert call["adapter_version"] in possible, (call["adapter_version"], start, activations)
        versions_seen.add(call["adapter_version"])
    assert {None, 1, 2, 3} <= versions_seen  # the load really overlapped every swap

    # Every answer named the version stored on its call, however long it took.
    stored = {call["request_id"]: call["adapter_version"] for call in calls}
    assert len(answers) == sum(sent)
    for answer in answers:
        version = stored[answer.request_id]
        label = "base" if version is None else str(version)
        assert (answer.header, answer.models) == (label, {f"rlproxy@{label}"}), answer

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
    assert (raw.parse().model, raw.headers["x-rlproxy-version"]) == ("rlproxy@3", "3")
    (row,) = db_rows(
        hserver.data_dir, "SELECT adapter_version FROM calls WHERE request_id = ?", (rid,)
    )
    assert row["adapter_version"] == 3
    models = httpx.get(f"{hserver.base_url}/models", timeout=30).json()["data"]
    assert "rlproxy@4" not in [m["id"] for m in models]
