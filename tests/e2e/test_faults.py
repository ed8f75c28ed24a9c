"""Faults that lose nothing, against a real server: a full disk under its database, and a trainer
child that crashes as soon as it starts.

The database lives on a small tmpfs mounted for this module (mounting needs root: CI and this
machine run the tests as root; elsewhere the module is skipped and says why) and is filled to
ENOSPC with a file of zeros. What must hold:

- a call generated before the server knew is not acknowledged (a 503 or a stream without
  `[DONE]`), and not stored;
- once it knows, /health answers 503 "degraded" with the reason, and a chat call is refused at
  once with 503 `storage_unavailable` (OpenAI's error shape) without generating anything;
- when the file is removed, the server recovers by itself (a probe write), with no restart.

The trainer command (`RLPROXY_TRAINER_COMMAND`) is a script that prints a line and exits 3 at
once: the server keeps serving, restarts it with growing delays, and shows it under "trainer" in
/health. No assertion depends on timing: tests wait for states, never for durations.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import sys
import time
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai import OpenAI

from tests.e2e.conftest import Server
from tests.e2e.helpers import own_server
from tests.full_disk import fill, small_tmpfs

CRASHING_TRAINER = [sys.executable, "-c", "print('trainer: cannot start (test)'); exit(3)"]


@dataclass(frozen=True)
class FaultServer:
    server: Server
    disk: Path  # the tmpfs holding the database

    def rows(self, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        uri = f"file:{self.disk / 'rlproxy.db'}?mode=ro"
        with closing(sqlite3.connect(uri, uri=True, timeout=30)) as conn:
            return conn.execute(sql, params).fetchall()

    def health(self) -> httpx.Response:
        return httpx.get(f"{self.server.url}/health", timeout=30)


@pytest.fixture(scope="module")
def disk(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with small_tmpfs(tmp_path_factory.mktemp("small-disk")) as mount_point:
        yield mount_point


@pytest.fixture(scope="module")
def faults(
    tmp_path_factory: pytest.TempPathFactory, model_data_dir: Path, disk: Path
) -> Iterator[FaultServer]:
    env = {
        "RLPROXY_DATABASE_URL": f"sqlite+aiosqlite:///{disk / 'rlproxy.db'}",
        "RLPROXY_STORAGE_PROBE_S": "0.2",
        "RLPROXY_TRAIN": "true",
        "RLPROXY_TRAINER_COMMAND": json.dumps(CRASHING_TRAINER),
        "RLPROXY_TRAINER_RESTART_S": "0.1",
        "RLPROXY_TRAINER_RESTART_MAX_S": "0.4",
    }
    data_dir = tmp_path_factory.mktemp("faults-data")  # logs and the trainer's log: a real disk
    with own_server(data_dir, model_data_dir, env) as server:
        yield FaultServer(server, disk)


@pytest.fixture(scope="module")
def client(faults: FaultServer) -> Iterator[OpenAI]:
    with OpenAI(
        base_url=faults.server.base_url, api_key="sk-test", max_retries=0, timeout=280
    ) as c:
        yield c


def _ask(client: OpenAI, text: str) -> Any:
    return client.chat.completions.with_raw_response.create(
        model="rlproxy", messages=[{"role": "user", "content": text}], max_tokens=8
    )


def _stored(faults: FaultServer, request_id: str) -> int:
    return len(faults.rows("SELECT id FROM calls WHERE request_id = ?", (request_id,)))


# ----------------------------------------------------------------------------- the trainer


def test_a_crash_looping_trainer_is_restarted_visibly_and_serving_goes_on(
    faults: FaultServer, client: OpenAI
) -> None:
    while (trainer := faults.health().json()["trainer"])["exits_in_a_row"] < 3:
        time.sleep(0.1)
    assert trainer["last_exit_code"] == 3
    assert trainer["restart_delay_s"] in (0.1, 0.2, 0.4)  # doubling from 0.1, capped at 0.4
    assert "trainer: cannot start (test)" in trainer["log_tail"]
    assert trainer["log"] == str(faults.server.data_dir / "trainer.log")
    # Serving is untouched: /health is ok and a call is answered and stored meanwhile.
    health = faults.health()
    assert health.status_code == 200 and health.json()["status"] == "ok"
    raw = _ask(client, "Say hello.")
    assert raw.parse().choices and _stored(faults, raw.headers["x-request-id"]) == 1
    # Further exits keep being restarted, at the capped delay, and each is logged.
    seen = trainer["exits_in_a_row"]
    while (trainer := faults.health().json()["trainer"])["exits_in_a_row"] < seen + 3:
        time.sleep(0.1)
    assert trainer["restarts"] >= seen + 2
    log = faults.server.log.read_text()
    assert "trainer exited with code 3" in log and "restarting in 0.4 s" in log


# ----------------------------------------------------------------------------- the full disk


async def _stream_acknowledged(url: str, text: str) -> tuple[int, bool]:
    """(HTTP status, whether `[DONE]` arrived) for one streamed call; a cut stream is (200, no)."""
    body = {
        "model": "rlproxy",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 8,
        "stream": True,
    }
    done = False
    async with httpx.AsyncClient(base_url=url, timeout=280) as http:
        try:
            async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                async for line in r.aiter_lines():
                    done = done or line == "data: [DONE]"
                return r.status_code, done
        except httpx.HTTPError:
            return 200, False


async def _json_call(url: str, text: str) -> httpx.Response:
    body = {"model": "rlproxy", "messages": [{"role": "user", "content": text}], "max_tokens": 8}
    async with httpx.AsyncClient(base_url=url, timeout=280) as http:
        return await http.post("/v1/chat/completions", json=body)


async def _generated_while_filling(url: str) -> tuple[httpx.Response, tuple[int, bool]]:
    return await asyncio.gather(
        _json_call(url, "Count to three."), _stream_acknowledged(url, "Count to four.")
    )


def test_a_full_disk_refuses_calls_early_and_recovers_without_restart(
    faults: FaultServer, client: OpenAI
) -> None:
    url = faults.server.url
    assert _ask(client, "Before the disk fills.").parse().choices
    stored_before = faults.rows("SELECT count(*) FROM calls")[0][0]
    filler = fill(faults.disk)

    # Calls that were generated before the server knew: neither is acknowledged.
    plain, (stream_status, stream_done) = asyncio.run(_generated_while_filling(url))
    assert plain.status_code == 503, plain.text
    assert plain.json()["error"]["code"] == "storage_unavailable"
    assert not stream_done  # refused (503) before it started, or cut off before [DONE]
    assert stream_status in (200, 503)

    # Now it knows: /health is a 503 with the reason, and calls are refused before generating.
    health = faults.health()
    assert health.status_code == 503
    state = health.json()
    assert state["status"] == "degraded" and "disk full" in state["reason"]
    assert state["storage"]["writable"] is False and state["storage"]["reason"] == "disk full"
    steps = state["engine"]["steps"]
    with pytest.raises(openai.InternalServerError) as refused:
        client.chat.completions.create(
            model="rlproxy", messages=[{"role": "user", "content": "Refused?"}], max_tokens=8
        )
    assert refused.value.status_code == 503
    error = refused.value.body
    assert isinstance(error, dict)
    assert error["type"] == "server_error" and error["code"] == "storage_unavailable"
    assert "cannot be written: disk full" in error["message"]
    streamed = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": "rlproxy", "messages": [{"role": "user", "content": "x"}], "stream": True},
        timeout=60,
    )
    assert streamed.status_code == 503 and streamed.json()["error"]["code"] == "storage_unavailable"
    assert faults.health().json()["engine"]["steps"] == steps  # nothing was generated
    assert faults.rows("SELECT count(*) FROM calls")[0][0] == stored_before  # nor stored

    filler.unlink()  # the operator frees space; nobody restarts anything
    while faults.health().status_code != 200:
        time.sleep(0.1)
    assert faults.health().json()["storage"] == {
        "writable": True,
        "reason": None,
        "error": None,
        "since": None,
    }
    raw = _ask(client, "After the disk has room again.")
    assert raw.parse().choices and _stored(faults, raw.headers["x-request-id"]) == 1
    log = faults.server.log.read_text()
    assert "the database cannot be written: disk full" in log
    assert "the database is writable again" in log
