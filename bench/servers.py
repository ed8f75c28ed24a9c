"""Processes for benchmarks: `rlproxy serve` on a free loopback port, or any command with a
health URL; each logs to a file and is waited on until healthy.

    from servers import start_server          # bench scripts run as `python bench/<name>.py`
    proc, url = start_server(data_dir, model_dir, {"RLPROXY_SCORING": "true"})
    with process(cmd, env, log_path, health_url): ...       # stopped (SIGTERM) on leaving
    async for chunk in sse_json(response): ...              # a streamed answer's JSON events

`SERVE_ONLY` turns the background trainer, scorer and adapter publisher off; a benchmark that
wants them passes them on in `env_extra`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent

SERVE_ONLY = {
    "RLPROXY_TRAIN": "false",
    "RLPROXY_SCORING": "false",
    "RLPROXY_PUBLISH_ADAPTERS": "false",
}


def stop_on_sigterm() -> None:
    """Take SIGTERM (`kill`, a nohup'd run stopped) as Ctrl-C: a proof's `except
    KeyboardInterrupt` writes what it measured and its `finally` stops its servers."""

    def interrupted(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupted)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(
    data_dir: Path, model_dir: Path, env_extra: dict[str, str] | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """Serve from `data_dir` (log: `data_dir/server.log`); return the process and its URL."""
    data_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {
        **os.environ,
        **SERVE_ONLY,
        "RLPROXY_DATA_DIR": str(data_dir),
        "RLPROXY_MODEL_DIR": str(model_dir),
        "RLPROXY_PORT": str(port),
        **(env_extra or {}),
    }
    log_path = data_dir / "server.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "proxy.cli", "serve"],
            env=env,
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(f"{url}/health", proc, log_path, timeout_s=180)
    except BaseException:  # never healthy, or Ctrl-C / SIGTERM while starting: no server left
        proc.kill()
        proc.wait()
        raise
    return proc, url


def wait_healthy(
    url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float = 240
) -> None:
    """Until `url` answers below 500; a process that exits or never answers is an error."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=2).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} did not become healthy:\n{log.read_text()[-3000:]}")


def stop(proc: subprocess.Popen[bytes], timeout_s: float = 20) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextmanager
def process(
    cmd: list[str], env: dict[str, str], log: Path, health: str
) -> Iterator[subprocess.Popen[bytes]]:
    """Run `cmd` (output to `log`) until the block ends; healthy when the block starts."""
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        wait_healthy(health, proc, log)
        yield proc
    finally:
        stop(proc)


async def sse_json(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The JSON events of a streamed answer (`data: {...}` lines), in order; `data: [DONE]`,
    comments and blank lines are skipped."""
    async for line in response.aiter_lines():
        data = line.removeprefix("data: ").strip()
        if data.startswith("{"):
            yield json.loads(data)
