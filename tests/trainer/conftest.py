"""Fixtures the trainer's tests share."""

from collections.abc import AsyncIterator
from pathlib import Path

import pytest_asyncio

from storage import Store


@pytest_asyncio.fixture(loop_scope="session")
async def store(tmp_path: Path) -> AsyncIterator[Store]:
    """tests/conftest.py's `store` on the session's event loop, for every test under
    tests/trainer (scoring's included): they all run there (`pytest.mark.asyncio(loop_scope=
    "session")`). A test on its own function loop would wait forever on this store's loop, so
    none is. A fresh SQLite store in the test's folder, closed after the test."""
    s = await Store.open(f"sqlite+aiosqlite:///{tmp_path / 'rlproxy.db'}")
    try:
        yield s
    finally:
        await s.close()
