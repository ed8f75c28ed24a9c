"""Versions and failures with `RLPROXY_ENGINE=vllm` and two vLLM-protocol replicas, under load.

- Three adapter versions published while four clients keep sending: no request fails, every
  version is loaded on both replicas as `rlproxy@N` before the policy flips to it, and every
  stored call carries a version that was active when it started, the one the replica was asked
  for. A version with a LoRA rank over the replicas' `--max-lora-rank` is refused by them and
  never serves.
- One replica killed (SIGKILL) while clients send: the other keeps answering, every call a client
  saw succeed is stored as completed, a call cut mid-answer is a 502 stored as an error that names
  the replica, and the restarted replica comes back into rotation with the active adapter loaded
  before it serves again.

Slow (`make test-slow`, about a minute on a quiet 2-core machine): CI runs the same load, the same
versions and the same SIGKILL against two real vLLM servers (tests/vllm_real/
test_real_vllm_versions.py, `make test-vllm`); what only the stand-in checks here is which model
name each call asked its replica for.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI

from tests.e2e.conftest import Server
from tests.e2e.helpers import db_rows, stored_prompts
from tests.e2e.test_adapters import write_random_lora
from tests.e2e.test_hotswap import _adapters, _publish, _wait_status
from tests.fakes.stack import FakeReplica, vllm_stack, wait_in_rotation

pytestmark = pytest.mark.slow

CLIENTS = 4


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, model_data_dir: Path
) -> Iterator[tuple[Server, list[FakeReplica]]]:
    env = {
        "RLPROXY_PUBLISH_ADAPTERS": "true",
        "RLPROXY_ROLLOUT": "false",  # each version serves at once (the guard: test_rollout.py)
        "RLPROXY_ADAPTER_POLL_S": "0.5",
    }
    with vllm_stack(tmp_path_factory.mktemp("vllm-replicas"), model_data_dir, env_extra=env) as s:
        yield s


class Load:
    """CLIENTS threads sending chat calls (streamed and not) until stopped; every outcome kept
    with its request id."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.stop = threading.Event()
        self.outcomes: list[dict[str, Any]] = []
        self.threads = [threading.Thread(target=self._loop, args=(i,)) for i in range(CLIENTS)]

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=180)

    def sent(self) -> int:
        return len(self.outcomes)

    def wait_for(self, count: int, timeout_s: float = 300) -> None:
        target = self.sent() + count
        deadline = time.monotonic() + timeout_s
        while self.sent() < target and time.monotonic() < deadline:
            time.sleep(0.2)

    def _loop(self, i: int) -> None:
        n = 0
        with httpx.Client(base_url=self.server.url, timeout=180) as http:
            while not self.stop.is_set():
                body = {
                    "model": "rlproxy",
                    "messages": [{"role": "user", "content": f"Count to ten. ({i}.{n})"}],
                    "max_tokens": 6,
                    "temperature": 0.7,
                    "stream": bool(n % 2),
                }
                self.outcomes.append(self._send(http, body))
                n += 1

    def _send(self, http: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
        started = time.time()
        try:
            with http.stream("POST", "/v1/chat/completions", json=body) as r:
                rid = r.headers.get("x-request-id")
                if not body["stream"]:
                    r.read()
                    ok = r.status_code == 200
                    return {
                        "id": rid,
                        "ok": ok,
                        "status": r.status_code,
                        "at": started,
                        "error": None if ok else r.text,
                    }
                error, done = None, False
                for line in r.iter_lines():
                    data = line.removeprefix("data: ").strip()
                    if data == "[DONE]":
                        done = True
                    elif data.startswith("{") and "error" in json.loads(data):
                        error = data
                ok = r.status_code == 200 and done and error is None
                return {"id": rid, "ok": ok, "status": r.status_code, "at": started, "error": error}
        except httpx.HTTPError as exc:
            return {"id": None, "ok": False, "status": None, "at": started, "error": repr(exc)}


def _stored(server: Server) -> dict[str, Any]:
    rows = db_rows(
        server.data_dir,
        "SELECT c.id, c.request_id, c.status, c.error, c.adapter_version, c.created_at, "
        "ch.completion_token_ids FROM calls c "
        "LEFT JOIN call_choices ch ON ch.call_id = c.id AND ch.choice_index = 0",
    )
    prompts = stored_prompts(server.data_dir, [r["id"] for r in rows])
    return {
        r["request_id"]: {**dict(r), "prompt_token_ids": prompts[r["id"]].token_ids} for r in rows
    }


def _replica_model(replicas: list[FakeReplica], call: dict[str, Any]) -> str | None:
    """The model name the replica that generated `call` was asked for."""
    prompt = call["prompt_token_ids"]
    ids = json.loads(call["completion_token_ids"] or "null")
    for replica in replicas:
        for c in replica.completions():
            if c["prompt_token_ids"] == prompt and c["choices"][0]["token_ids"] == ids:
                return str(c["model"])
    return None


def test_three_versions_published_under_load(
    stack: tuple[Server, list[FakeReplica]], model_data_dir: Path, tmp_path: Path
) -> None:
    server, replicas = stack
    lora = tmp_path / "lora"
    write_random_lora(model_data_dir, lora)
    root = server.data_dir / "checkpoints" / "rlproxy"
    with Load(server) as load:
        load.wait_for(CLIENTS)
        for version in (1, 2, 3):
            _publish(lora, root, version)
            _wait_status(server, version, "loaded")
            for replica in replicas:  # loaded everywhere before the policy served it
                names = [m["id"] for m in httpx.get(f"{replica.url}/v1/models").json()["data"]]
                assert f"rlproxy@{version}" in names
            load.wait_for(2 * CLIENTS)

    assert [o for o in load.outcomes if not o["ok"]] == []
    adapters = _adapters(server)
    assert adapters[3]["active"]
    activations = sorted((adapters[v]["activated_at"], v) for v in (1, 2, 3))

    def active_at(t: float) -> int | None:
        current = None
        for at, v in activations:
            if at <= t:
                current = v
        return current

    stored = _stored(server)
    assert {o["id"] for o in load.outcomes} <= set(stored)
    seen = set()
    for o in load.outcomes:
        call = stored[o["id"]]
        assert call["status"] == "completed"
        start = call["created_at"]
        possible = {active_at(start + d) for d in (-0.5, -0.25, 0.0, 0.25, 0.5)}
        assert call["adapter_version"] in possible, (call["adapter_version"], start, activations)
        version = call["adapter_version"]
        expected = "smollm2-135m" if version is None else f"rlproxy@{version}"
        assert _replica_model(replicas, call) == expected
        seen.add(version)
    assert {None, 1, 2, 3} <= seen

    # A rank over the replicas' --max-lora-rank (16): vLLM refuses it, version 3 keeps serving.
    big = tmp_path / "big"
    write_random_lora(model_data_dir, big)
    config = json.loads((big / "adapter_config.json").read_text())
    config["r"] = 32
    (big / "adapter_config.json").write_text(json.dumps(config))
    _publish(big, root, 4)
    rejected = _wait_status(server, 4, "rejected")
    assert "max_lora_rank" in rejected["error"]
    assert _adapters(server)[3]["active"]


def test_a_replica_killed_mid_load_loses_nothing_acknowledged_and_rejoins(
    stack: tuple[Server, list[FakeReplica]],
) -> None:
    server, replicas = stack
    active = httpx.get(f"{server.url}/health", timeout=30).json()["active_version"]
    victim, survivor = replicas
    with Load(server) as load:
        load.wait_for(2 * CLIENTS)
        before = load.sent()
        victim.kill()
        load.wait_for(3 * CLIENTS)
        after_kill = load.sent()
        victim.start()
        victim.wait()
        wait_in_rotation(server, 2)
        served_before = len(victim.completions())
        load.wait_for(4 * CLIENTS)

    failed = [o for o in load.outcomes if not o["ok"]]
    # Only requests in flight on the victim when it died may fail, and only with a 502.
    assert len(failed) <= CLIENTS, failed
    assert all(o["status"] in (200, 502) for o in failed), failed
    assert load.sent() > after_kill > before
    stored = _stored(server)
    for o in load.outcomes:
        if o["ok"]:
            assert stored[o["id"]]["status"] == "completed"
        elif o["id"] is not None:
            assert stored[o["id"]]["status"] == "error"
            assert victim.url in (stored[o["id"]]["error"] or "")
    # Back in rotation with the active adapter loaded first, and serving again.
    names = [m["id"] for m in httpx.get(f"{victim.url}/v1/models").json()["data"]]
    if active is not None:
        assert f"rlproxy@{active}" in names
    assert len(victim.completions()) > served_before
    with OpenAI(base_url=server.base_url, api_key="sk-test", max_retries=0) as c:
        r = c.chat.completions.create(
            model="rlproxy", messages=[{"role": "user", "content": "Hi"}], max_tokens=3
        )
        assert r.choices[0].message.content is not None
    assert survivor.completions()
