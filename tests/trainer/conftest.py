"""Fixtures the trainer's tests share."""

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from storage import Store


@pytest.fixture
async def store(tmp_path: Path) -> AsyncIterator[Store]:
    """A real SQLite store in the test's own folder, closed after the test."""
    s = await Store.open(f"sqlite+aiosqlite:///{tmp_path / 'rlproxy.db'}")
    try:
        yield s
    finally:
        await s.close()
