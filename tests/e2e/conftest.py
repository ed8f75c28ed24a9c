"""A real rlproxy server on loopback, started once per test session as `rlproxy serve`.

Tests talk to it with real clients (openai, langchain-openai, llama-index) through
`OPENAI_BASE_URL`-style base URLs. Its data directory is a fresh temporary folder; the model
cache is shared with the other tests (see tests/conftest.py).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import pytest_asyncio


@dataclass(frozen=True)
class Server:
    url: str  # http://127.0.0.1:PORT
    data_dir: Path
    model_name: str
    log: Path

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    data_dir: Path,
    model_dir: Path,
    env_extra: dict[str, str] | None = None,
    log: Path | None = None,
):
    """`rlproxy serve` on a free loopback port, healthy; its output goes to `log` (default
    `data_dir/server.log`; replicas sharing a data directory each need their own)."""
    port = free_port()
    log = log or data_dir / "server.log"
    data_dir.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "RLPROXY_DATA_DIR": str(data_dir),
        "RLPROXY_MODEL_DIR": str(model_dir),
        "RLPROXY_PORT": str(port),
        "RLPROXY_HOST": "127.0.0.1",
        # Background scoring is tested by the suites that turn it on; elsewhere the local judge
        # would compete with the requests under test for the two CPU cores.
        "RLPROXY_SCORING": "false",
        # Likewise training and auto-publishing adapters: the suites about them turn them on.
        "RLPROXY_TRAIN": "false",
        "RLPROXY_PUBLISH_ADAPTERS": "false",
        # Judge checks add a canary member or a second judge call to some groups, which the
        # suites scripting a fixed reply per group do not expect; test_judge_gate.py turns
        # them on.
        "RLPROXY_JUDGE_CHECKS": "false",
        # The held-out split keeps a share of tasks out of training and serves half of them with
        # the base: a suite that trains on a few tasks would find one never trains. Tested by
        # test_evaluation.py, which turns it on.
        "RLPROXY_EVAL_SHARE": "0",
        **(env_extra or {}),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy.cli", "serve"],
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url, log
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"server did not become healthy:\n{log.read_text()}")


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory, model_data_dir: Path) -> Iterator[Server]:
    data_dir = tmp_path_factory.mktemp("server-data")
    proc, url, log = start_server(data_dir, model_data_dir)
    try:
        yield Server(url=url, data_dir=data_dir, model_name="rlproxy", log=log)
    finally:
        stop_server(proc)


# ----------------------------------------------------------------------------- clients


@pytest.fixture(scope="session")
def client(server: Server):  # -> openai.OpenAI
    from openai import OpenAI

    with OpenAI(base_url=server.base_url, api_key="sk-test", max_retries=0, timeout=280) as c:
        yield c


@pytest_asyncio.fixture(loop_scope="function")
async def aclient(server: Server):  # -> openai.AsyncOpenAI
    from openai import AsyncOpenAI

    async with AsyncOpenAI(
        base_url=server.base_url, api_key="sk-test", max_retries=0, timeout=280
    ) as c:
        yield c


@pytest.fixture(scope="session")
def pool() -> Iterator[ThreadPoolExecutor]:
    """Threads for sending a module's independent requests at once (one engine batch, not N)."""
    with ThreadPoolExecutor(max_workers=16, thread_name_prefix="e2e") as executor:
        yield executor
