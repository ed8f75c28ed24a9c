"""The fuzz suites' own `rlproxy serve` on loopback: the real model, a fresh data directory.

`make test-fuzz` runs these suites (marker `fuzz`, left out of the default run). The server
answers with at most 8 tokens when a request sets no `max_tokens`, so that generated requests
that the server accepts finish in a second, not in minutes.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import Server, start_server, stop_server

FUZZ_ENV = {
    "RLPROXY_DEFAULT_MAX_TOKENS": "8",
    # Every request here comes from one address; the per-caller limits have their own suite.
    "RLPROXY_CALLER_REQUESTS_PER_MINUTE": "0",
}

try:  # the `fuzz` extra (`make test-fuzz` installs it); the default suite runs without it
    import schemathesis  # noqa: F401
except ImportError:
    collect_ignore = ["test_schemathesis.py"]


@pytest.fixture(scope="session")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory, model_data_dir: Path) -> Iterator[Server]:
    data_dir = tmp_path_factory.mktemp("fuzz-server")
    proc, url, log = start_server(data_dir, model_data_dir, FUZZ_ENV)
    try:
        yield Server(url=url, data_dir=data_dir, model_name="rlproxy", log=log)
    finally:
        stop_server(proc)
