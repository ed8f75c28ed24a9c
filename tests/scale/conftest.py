"""Fixtures for the scale tests (marker `scale`, `make test-scale`): several replicas on one
Postgres behind HAProxy (`tests/scale/deployment.py`). Without haproxy they skip and say how to
get it, or fail in CI, which runs them (tests/required.py); Postgres and Redis are the machine's
(always running here and in CI)."""

from __future__ import annotations

import shutil

import pytest

from tests.required import missing


@pytest.fixture(scope="session", autouse=True)
def haproxy() -> str:
    binary = shutil.which("haproxy")
    if binary is None:
        missing("no haproxy on this machine", "`make test-scale` installs it (apt-get, as root)")
    return binary
