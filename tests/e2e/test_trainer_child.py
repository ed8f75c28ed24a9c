"""The trainer child never outlives its server: a SIGKILLed server takes its trainer with it.

`rlproxy serve` starts `rlproxy train` as a child in its own session (so a Ctrl-C reaches only
the server). Before, a server killed with SIGKILL left the trainer running, reparented, and a
restart then ran two trainers on one database and checkpoint folder.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import start_server

pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs Linux's /proc")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_a_sigkilled_server_takes_its_trainer_with_it(tmp_path: Path, model_data_dir: Path) -> None:
    proc, _, log = start_server(tmp_path, model_data_dir, {"RLPROXY_TRAIN": "true"})
    try:
        found = re.search(r"trainer started \(pid (\d+)\)", log.read_text())
        assert found, log.read_text()
        trainer = int(found.group(1))
        assert _alive(trainer)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.monotonic() + 60  # a liveness bound, not a speed check
    while _alive(trainer) and time.monotonic() < deadline:
        time.sleep(0.2)
    still_running = _alive(trainer)
    if still_running:
        os.kill(trainer, signal.SIGKILL)  # leave nothing behind, then fail
    assert not still_running, (tmp_path / "trainer.log").read_text()
