"""Nothing acknowledged is lost: SIGKILL the server mid-load, restart it, find every row.

Many concurrent requests (streamed and not) run against a real server; once some have completed,
the server gets SIGKILL. A request counts as acknowledged when its client received the whole
response: the JSON body, or the `[DONE]` of a stream. After a restart on the same data directory
every acknowledged request (matched by its x-request-id) must have its call row with prompt and
completion token ids, and SQLite's `PRAGMA integrity_check` must say `ok`.

The engine batches 4 rows at a time here so that requests finish in waves and the kill lands
while some are still running. The 100-request run is marked slow; a 20-request run is not.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sqlite3
import subprocess
from contextlib import closing, suppress
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import start_server, stop_server
from tests.e2e.helpers import db_rows, stored_prompts


@dataclass
class Outcome:
    index: int
    stream: bool
    request_id: str | None = None
    complete: bool = False


async def _one(client: httpx.AsyncClient, i: int, stream: bool, out: Outcome) -> None:
    body = {
        "model": "rlproxy",
        "messages": [{"role": "user", "content": f"Count from {i} upwards."}],
        "max_tokens": 16,
        "temperature": 1.0,
        "stream": stream,
    }
    if not stream:
        r = await client.post("/v1/chat/completions", json=body)
        out.request_id = r.headers.get("x-request-id")
        out.complete = r.status_code == 200 and bool(r.json()["choices"])
        return
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        out.request_id = r.headers.get("x-request-id")
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                out.complete = r.status_code == 200
            elif line.startswith("data: ") and "error" in json.loads(line[6:]):
                return


async def _load_then_kill(
    url: str, proc: subprocess.Popen[bytes], n: int, kill_after: int
) -> list[Outcome]:
    outcomes = [Outcome(i, stream=i % 2 == 1) for i in range(n)]
    limits = httpx.Limits(max_connections=n + 10, max_keepalive_connections=n + 10)
    timeout = httpx.Timeout(600, connect=60)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=timeout) as client:

        async def guarded(o: Outcome) -> None:
            # The server may die under this request: then it is simply not acknowledged.
            with suppress(httpx.HTTPError, json.JSONDecodeError):
                await _one(client, o.index, o.stream, o)

        def ready() -> bool:  # enough acknowledged, of both kinds, to make the check worth it
            done = [o for o in outcomes if o.complete]
            kinds = {o.stream for o in done}
            return len(done) >= kill_after and kinds == {True, False}

        tasks = [asyncio.create_task(guarded(o)) for o in outcomes]
        while not ready() and not all(t.done() for t in tasks):
            await asyncio.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        await asyncio.gather(*tasks)
    return outcomes


def _check_after_restart(data_dir: Path, model_dir: Path, outcomes: list[Outcome]) -> None:
    done = [o for o in outcomes if o.complete]
    assert all(o.request_id for o in done)
    proc, _, _ = start_server(data_dir, model_dir)  # restart: recovery and migrations run
    try:
        for o in done:
            rows = db_rows(
                data_dir,
                "SELECT id, status FROM calls WHERE request_id = ?",
                (o.request_id,),
            )
            assert len(rows) == 1, f"acknowledged request {o.request_id} has no row"
            call = rows[0]
            assert call["status"] == "completed"
            prompt = stored_prompts(data_dir, [call["id"]])[call["id"]]
            assert prompt.token_ids, "prompt token ids missing"
            choices = db_rows(
                data_dir,
                "SELECT completion_token_ids FROM call_choices WHERE call_id = ?",
                (call["id"],),
            )
            assert choices and json.loads(choices[0]["completion_token_ids"])
    finally:
        stop_server(proc)
    with closing(sqlite3.connect(data_dir / "rlproxy.db")) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]


def _run(tmp_path: Path, model_dir: Path, n: int, kill_after: int) -> None:
    data_dir = tmp_path / "crash-data"
    # Every request in flight at the kill, none refused by the per-caller or queue limits.
    env = {
        "RLPROXY_MAX_BATCH_SIZE": "4",
        "RLPROXY_CALLER_CONCURRENCY": "0",
        "RLPROXY_MAX_QUEUED_ROWS": "0",
    }
    proc, url, _ = start_server(data_dir, model_dir, env)
    try:
        outcomes = asyncio.run(_load_then_kill(url, proc, n, kill_after))
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    completed = sum(o.complete for o in outcomes)
    assert completed >= kill_after
    assert completed < n, "every request finished before the kill: nothing was in flight"
    assert any(o.complete and o.stream for o in outcomes)
    assert any(o.complete and not o.stream for o in outcomes)
    _check_after_restart(data_dir, model_dir, outcomes)


def test_sigkill_loses_nothing_acknowledged_20(tmp_path: Path, model_data_dir: Path) -> None:
    _run(tmp_path, model_data_dir, n=20, kill_after=8)


@pytest.mark.slow
def test_sigkill_loses_nothing_acknowledged_100(tmp_path: Path, model_data_dir: Path) -> None:
    _run(tmp_path, model_data_dir, n=100, kill_after=40)
