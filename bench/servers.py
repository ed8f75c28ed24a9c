"""Starting `rlproxy serve` for a benchmark: a free loopback port, a log file, wait for health.

    from servers import start_server          # bench scripts run as `python bench/<name>.py`
    proc, url = start_server(data_dir, model_dir, {"RLPROXY_SCORING": "true"})

`SERVE_ONLY` turns the background trainer, scorer and adapter publisher off; a benchmark that
wants them passes them on in `env_extra`.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent

SERVE_ONLY = {
    "RLPROXY_TRAIN": "false",
    "RLPROXY_SCORING": "false",
    "RLPROXY_PUBLISH_ADAPTERS": "false",
}


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
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {log_path}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"server did not become healthy; see {log_path}")
