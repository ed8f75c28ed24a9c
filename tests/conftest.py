"""Shared fixtures: the real embedded model, loaded once per test session, and a fresh SQLite
store per test.

The fp32 checkpoint is cached under the repository's `rlproxy-data/` (or `RLPROXY_TEST_MODEL_DIR`)
so that only the first test run pays for the GGUF conversion; every database a test writes lives
under its own `tmp_path`.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def model_data_dir() -> Path:
    """Data directory that holds the cached fp32 model (shared, read-mostly).

    The GGUF is converted here once, before any test starts a server on it."""
    from proxy.engines.loader import ensure_fp32_cache

    path = Path(os.environ.get("RLPROXY_TEST_MODEL_DIR", REPO / "rlproxy-data"))
    ensure_fp32_cache(path)
    return path


@pytest.fixture(scope="session")
def loaded_model(model_data_dir: Path):  # -> proxy.engines.loader.LoadedModel
    from proxy.engines.loader import load_model

    return load_model(model_data_dir)


@pytest.fixture(scope="session")
def tokenizer(loaded_model):
    return loaded_model.tokenizer


@pytest_asyncio.fixture(loop_scope="function")
async def store(tmp_path: Path) -> AsyncIterator[Any]:  # -> storage.Store
    """A fresh SQLite store in the test's folder, opened on the test's own event loop (tests
    marked `loop_scope="function"`); a module that runs its tests on another loop defines its
    own `store` (tests/trainer/conftest.py: the session's loop)."""
    from storage import Store

    s = await Store.open(f"sqlite+aiosqlite:///{tmp_path / 'rlproxy.db'}")
    try:
        yield s
    finally:
        await s.close()
