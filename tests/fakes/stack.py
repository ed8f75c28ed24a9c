"""rlproxy with `RLPROXY_ENGINE=vllm` in front of vLLM-protocol replicas (`vllm_server.py`), all
real processes on loopback: for the end-to-end tests and `bench/bench_vllm.py`.

    with vllm_stack(data_dir, model_dir, replicas=2) as (server, replicas):
        ...                                   # server: tests.e2e.conftest.Server
        replicas[0].kill()                    # SIGKILL: dies mid-answer
        replicas[0].start(); replicas[0].wait()   # back on the same port
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent.parent


@dataclass
class FakeReplica:
    port: int
    model_dir: Path
    folder: Path
    max_lora_rank: int = 16
    faults: tuple[str, ...] = ()  # vllm_server.py's fault flags, e.g. ("--no-runtime-lora",)
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def record(self) -> Path:
        """Every completion this replica finished, one JSON line each (all its lives)."""
        return self.folder / "completions.jsonl"

    def start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.starts += 1
        log = (self.folder / f"replica-{self.starts}.log").open("w")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.fakes.vllm_server",
                "--port",
                str(self.port),
                "--model-dir",
                str(self.model_dir),
                "--max-lora-rank",
                str(self.max_lora_rank),
                "--record",
                str(self.record),
                *self.faults,
            ],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
        )

    def wait(self, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"fake vLLM on {self.port} exited: {self.log_text()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"fake vLLM on {self.port} did not start: {self.log_text()}")

    def kill(self) -> None:
        """SIGKILL: no goodbye, connections cut mid-answer."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_text(self) -> str:
        return (self.folder / f"replica-{self.starts}.log").read_text()[-3000:]

    def completions(self) -> list[dict[str, Any]]:
        if not self.record.exists():
            return []
        return [json.loads(line) for line in self.record.read_text().splitlines() if line]

    def admin_calls(self) -> list[str]:
        return list(httpx.get(f"{self.url}/fake/admin_calls", timeout=10).json()["calls"])


def start_replicas(folder: Path, model_dir: Path, count: int) -> list[FakeReplica]:
    from tests.e2e.conftest import free_port

    replicas = [FakeReplica(free_port(), model_dir, folder / f"r{i}") for i in range(count)]
    for replica in replicas:
        replica.start()
    return replicas


def wait_in_rotation(server: Any, count: int, timeout_s: float = 120) -> None:
    """Until rlproxy's /health shows `count` healthy replicas."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        body = httpx.get(f"{server.url}/health", timeout=10).json()
        replicas = body.get("engine", {}).get("replicas", [])
        if sum(1 for r in replicas if r["healthy"]) >= count:
            return
        time.sleep(0.2)
    raise RuntimeError(f"rlproxy never had {count} healthy replicas")


@contextmanager
def rlproxy_in_front(
    data_dir: Path,
    model_dir: Path,
    replicas: Sequence[Any],
    env_extra: dict[str, str] | None = None,
) -> Iterator[Any]:
    """One `rlproxy serve` with the vllm engine in front of `replicas` (started, not yet
    necessarily up): `FakeReplica`s here, or real vLLM servers (`tests.vllm_real.replica`)."""
    from tests.e2e.conftest import Server, start_server, stop_server

    env = {
        "RLPROXY_ENGINE": "vllm",
        "RLPROXY_VLLM_URLS": json.dumps([r.url for r in replicas]),
        "RLPROXY_VLLM_HEALTH_INTERVAL_S": "0.5",
        **(env_extra or {}),
    }
    # rlproxy starts beside the replicas (its /health is 200 once one of them is up).
    proc, url, log = start_server(data_dir, model_dir, env)
    try:
        for replica in replicas:
            replica.wait()
        server = Server(url=url, data_dir=data_dir, model_name="rlproxy", log=log)
        wait_in_rotation(server, len(replicas))
        yield server
    finally:
        stop_server(proc)


@contextmanager
def vllm_stack(
    data_dir: Path,
    model_dir: Path,
    *,
    replicas: int = 2,
    env_extra: dict[str, str] | None = None,
) -> Iterator[tuple[Any, list[FakeReplica]]]:
    """`replicas` fake vLLM servers and one `rlproxy serve` with the vllm engine in front."""
    fakes = start_replicas(data_dir / "replicas", model_dir, replicas)
    try:
        with rlproxy_in_front(data_dir, model_dir, fakes, env_extra) as server:
            yield server, fakes
    finally:
        for fake in fakes:
            fake.stop()
