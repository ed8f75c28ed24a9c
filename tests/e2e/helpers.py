"""Helpers shared by the storage-facing end-to-end tests: own servers, the /rl API, the database.

Each test module that needs special settings (an idle timeout, upstream models) starts its own
`rlproxy serve` through `tests/e2e/conftest.py`'s `start_server`, so its trajectories never mix
with other modules' and its settings stay its own.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

import httpx

from storage.prompt_chunks import Prompt, sqlite_prompts
from tests.e2e.conftest import Server, start_server, stop_server


@contextmanager
def own_server(
    data_dir: Path, model_dir: Path, env_extra: dict[str, str] | None = None
) -> Iterator[Server]:
    proc, url, log = start_server(data_dir, model_dir, env_extra)
    try:
        yield Server(url=url, data_dir=data_dir, model_name="rlproxy", log=log)
    finally:
        stop_server(proc)


def list_trajectories(server: Server, **params: Any) -> list[dict[str, Any]]:
    """Every page of GET /rl/trajectories with these filters."""
    items: list[dict[str, Any]] = []
    cursor = None
    while True:
        query = {k: v for k, v in {**params, "cursor": cursor}.items() if v is not None}
        r = httpx.get(f"{server.url}/rl/trajectories", params=query, timeout=60)
        r.raise_for_status()
        page = r.json()
        items += page["data"]
        cursor = page["next_cursor"]
        if cursor is None:
            return items


def get_trajectory(server: Server, trajectory_id: str) -> dict[str, Any]:
    r = httpx.get(f"{server.url}/rl/trajectories/{trajectory_id}", timeout=60)
    r.raise_for_status()
    return r.json()


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str, poll_s: float = 1.0) -> Any:
    """Poll `predicate` until it returns something truthy (returned), or fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out waiting for {what}")


def typed_events(
    url: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """The events of a typed stream (Responses API, Anthropic Messages) as sent, in order, each
    checked to carry its `event:` line's type."""
    out = []
    with httpx.stream(
        "POST", url, json={**body, "stream": True}, headers=headers, timeout=120
    ) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        kind = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data = json.loads(line.removeprefix("data: "))
                assert data["type"] == kind
                out.append(data)
    return out


def db_rows(data_dir: Path, sql: str, params: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
    """Rows straight from the server's SQLite file (read-only, beside the running server)."""
    uri = f"file:{data_dir / 'rlproxy.db'}?mode=ro"
    with closing(sqlite3.connect(uri, uri=True, timeout=30)) as conn:
        conn.row_factory = sqlite3.Row
        return conn.execute(sql, params).fetchall()


MESSAGE_LIKE = (
    "EXISTS (SELECT 1 FROM prompt_chunks p WHERE p.body LIKE ? "
    "AND instr(calls.message_refs, '\"' || p.hash || '\"'))"
)
"""SQL condition on `calls`: one of its request messages' JSON is LIKE the parameter (messages
are stored by chunk: `storage.prompt_chunks`)."""


def stored_prompts(data_dir: Path, call_ids: list[str]) -> dict[str, Prompt]:
    """Each call's request messages and prompt token ids, joined from their stored chunks
    (`storage.prompt_chunks`), read-only beside the running server."""
    uri = f"file:{data_dir / 'rlproxy.db'}?mode=ro"
    with closing(sqlite3.connect(uri, uri=True, timeout=30)) as conn:
        return sqlite_prompts(conn, call_ids)


def calls_of(data_dir: Path, trajectory_id: str) -> list[dict[str, Any]]:
    """The stored calls of a trajectory in turn order, with their prompts (`request_messages`,
    `prompt_token_ids`) and their choices' token ids."""
    calls = db_rows(
        data_dir,
        "SELECT * FROM calls WHERE trajectory_id = ? ORDER BY turn_index, recorded_at",
        (trajectory_id,),
    )
    prompts = stored_prompts(data_dir, [row["id"] for row in calls])
    out = []
    for row in calls:
        call = dict(row)
        call["request_messages"] = prompts[row["id"]].messages
        choices = db_rows(
            data_dir,
            "SELECT * FROM call_choices WHERE call_id = ? ORDER BY choice_index",
            (row["id"],),
        )
        call["choices"] = [dict(c) for c in choices]
        call["prompt_token_ids"] = prompts[row["id"]].token_ids
        for c in call["choices"]:
            c["completion_token_ids"] = json.loads(c["completion_token_ids"] or "null")
        out.append(call)
    return out
