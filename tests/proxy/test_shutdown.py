"""SIGTERM: what rlproxy does when a container (or a supervisor) stops it.

- A chat request cancelled by the server's shutdown (uvicorn cancels requests still running when
  its graceful-shutdown time is up) cancels its generation and waits for it, so the service stores
  the call as interrupted while the store is still open, instead of leaving it running past the
  shutdown, unstored.
- `rlproxy train` on SIGTERM stops its loop and exits without tearing down the interpreter
  (which took 8-10 s of garbage collection on CPU, long enough for serve or `docker stop` to
  SIGKILL it). tests/deploy/test_image.py checks both in a real container under load.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from proxy.api.serving import unless_disconnected

REPO = Path(__file__).resolve().parents[2]


class _ListeningClient:
    """The ASGI `receive` of a client that stays connected (no http.disconnect)."""

    async def receive(self) -> dict:
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}


async def test_a_request_cancelled_by_shutdown_finishes_storing_its_call() -> None:
    started, stored = asyncio.Event(), asyncio.Event()

    async def generation() -> dict:
        started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            # What the chat service does: store the call as interrupted, shielded.
            await asyncio.shield(asyncio.sleep(0.05))
            stored.set()
            raise
        return {}

    request = asyncio.ensure_future(unless_disconnected(_ListeningClient(), generation()))
    await started.wait()
    request.cancel()  # uvicorn: "Task cancelled, timeout graceful shutdown exceeded"
    with pytest.raises(asyncio.CancelledError):
        await request
    assert stored.is_set()  # stored before the cancellation reached the server's shutdown


def test_train_exits_on_sigterm_without_tearing_down_the_interpreter(
    tmp_path: Path, model_data_dir: Path
) -> None:
    # A startup hook in the child: an atexit handler that runs only if the interpreter is torn
    # down the slow way (os._exit skips it).
    hook = tmp_path / "hook"
    hook.mkdir()
    marker = tmp_path / "interpreter-torn-down"
    (hook / "sitecustomize.py").write_text(
        f"import atexit, pathlib\natexit.register(pathlib.Path({str(marker)!r}).touch)\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": f"{hook}{os.pathsep}{REPO}",
        "RLPROXY_DATA_DIR": str(tmp_path / "data"),
        "RLPROXY_MODEL_DIR": str(model_data_dir),
        "RLPROXY_TRAIN_THREADS": "1",
    }
    log = tmp_path / "train.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "proxy.cli", "train"], env=env, stdout=out, stderr=out
        )
    try:
        deadline = time.monotonic() + 300
        while "training rlproxy into" not in log.read_text(errors="replace"):
            assert proc.poll() is None, log.read_text(errors="replace")
            assert time.monotonic() < deadline, "the trainer never started"
            time.sleep(0.5)
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
        print(f"\nrlproxy train exited {time.monotonic() - sent:.1f} s after SIGTERM")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = log.read_text(errors="replace")
    assert code == 0, text[-2000:]
    assert "trainer stopping" in text
    assert not marker.exists()
