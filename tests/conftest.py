"""Shared fixtures: the real embedded model, loaded once per test session.

The fp32 checkpoint is cached under the repository's `rlproxy-data/` (or `RLPROXY_TEST_MODEL_DIR`)
so that only the first test run pays for the GGUF conversion; every database a test writes lives
under its own `tmp_path`.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

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
