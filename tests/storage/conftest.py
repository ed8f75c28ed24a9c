"""Fixtures for the storage tests: a fresh database per test, on SQLite and on Postgres.

SQLite: a new file under `tmp_path`. Postgres (always running here and in CI, trust auth): a new
schema per test in the `test` database, dropped afterwards, so tests never see each other's rows
and other suites sharing the server are untouched. Set RLPROXY_TEST_POSTGRES_URL to point
elsewhere.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from sqlalchemy.engine import make_url

from storage import CallRecord, ChoiceRecord, Store

POSTGRES_URL = os.environ.get(
    "RLPROXY_TEST_POSTGRES_URL", "postgresql+asyncpg://postgres@127.0.0.1:5432/test"
)


def _asyncpg_dsn(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


@dataclass
class Database:
    """One test's database; `open` gives stores on it that are closed after the test."""

    backend: str  # "sqlite" | "postgres"
    url: str
    schema: str | None = None
    stores: list[Store] = field(default_factory=list)

    async def open(self, **kwargs: Any) -> Store:
        if self.schema is not None:
            kwargs.setdefault("postgres_schema", self.schema)
        store = await Store.open(self.url, **kwargs)
        self.stores.append(store)
        return store

    async def close_all(self) -> None:
        for store in self.stores:
            await store.close()
        self.stores.clear()


async def _postgres_database() -> Database:
    schema = f"t_{uuid.uuid4().hex[:16]}"
    conn = await asyncpg.connect(_asyncpg_dsn(POSTGRES_URL))
    try:
        await conn.execute(f'CREATE SCHEMA "{schema}"')
    finally:
        await conn.close()
    return Database("postgres", POSTGRES_URL, schema)


async def _drop_schema(schema: str) -> None:
    conn = await asyncpg.connect(_asyncpg_dsn(POSTGRES_URL))
    try:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
    finally:
        await conn.close()


def sqlite_database(tmp_path: Path) -> Database:
    return Database("sqlite", f"sqlite+aiosqlite:///{tmp_path / 'rlproxy.db'}")


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
async def db(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Database]:
    database = (
        sqlite_database(tmp_path) if request.param == "sqlite" else await _postgres_database()
    )
    try:
        yield database
    finally:
        await database.close_all()
        if database.schema is not None:
            await _drop_schema(database.schema)


@pytest.fixture
async def sqlite_db(tmp_path: Path) -> AsyncIterator[Database]:
    database = sqlite_database(tmp_path)
    try:
        yield database
    finally:
        await database.close_all()


@pytest.fixture
async def store(db: Database) -> Store:
    return await db.open()


def make_call(
    messages: list[dict[str, Any]],
    answer: dict[str, Any] | str | None = "ok",
    *,
    created_at: float | None = None,
    duration_s: float = 0.01,
    **overrides: Any,
) -> CallRecord:
    """A realistic CallRecord for `messages`; `answer` is choice 0's assistant message."""
    created = time.time() if created_at is None else created_at
    choices = []
    if answer is not None:
        message = {"role": "assistant", "content": answer} if isinstance(answer, str) else answer
        choices.append(
            ChoiceRecord(
                index=0,
                message=message,
                finish_reason="tool_calls" if message.get("tool_calls") else "stop",
                completion_token_ids=[11, 22, 33],
                completion_logprobs=[-0.5, -1.25, -0.0078125],
            )
        )
    fields: dict[str, Any] = {
        "id": uuid.uuid4().hex,
        "request_id": f"req-{uuid.uuid4().hex[:8]}",
        "created_at": created,
        "finished_at": created + duration_s,
        "model_requested": "policy",
        "engine": "local",
        "request_messages": messages,
        "params": {"temperature": 1.0},
        "choices": choices,
        "prompt_token_ids": [1, 2, 3, 4],
        "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7},
        "latency_s": duration_s,
        "status": "completed" if answer is not None else "error",
        "error": None if answer is not None else "engine failed",
    }
    fields.update(overrides)
    return CallRecord(**fields)


@pytest.fixture(name="make_call")
def make_call_fixture() -> Callable[..., CallRecord]:
    return make_call
