"""`rlproxy serve` runs the trainer beside it: `rlproxy train` as a child process.

On CPU the trainer needs its own copy of the model and its own interpreter, so serving never
waits on a training step (the GIL and torch's threads would otherwise make every request wait).
The child gets the server's settings through the environment and shares its database and
checkpoint folder; its output goes to `<data-dir>/trainer.log`. It is stopped with the server,
and on Linux it also stops when the server dies without stopping it (SIGKILL, a crash):
`stop_with_parent`, called by the child, asks the kernel for a SIGTERM then.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys

from proxy.settings import Settings

logger = logging.getLogger(__name__)

PARENT_PID_ENV = "RLPROXY_TRAINER_PARENT_PID"


class TrainerProcess:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        s = self.settings
        env = {
            **os.environ,
            "RLPROXY_DATA_DIR": str(s.data_dir),
            "RLPROXY_MODEL_NAME": s.model_name,
            "RLPROXY_DATABASE_URL": s.resolved_database_url,
        }
        env["RLPROXY_TRAIN_THREADS"] = str(s.train_threads or 1)
        env[PARENT_PID_ENV] = str(os.getpid())  # the child stops when this process dies
        if s.model_dir is not None:
            env["RLPROXY_MODEL_DIR"] = str(s.model_dir)
        log = (s.data_dir / "trainer.log").open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "proxy.cli", "train"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a Ctrl-C on the server's terminal reaches us, not it
        )
        log.close()
        logger.info(
            "trainer started (pid %d); its log is %s", self.proc.pid, s.data_dir / "trainer.log"
        )

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("trainer did not stop in %.0f s; killing it", timeout_s)
            self.proc.kill()
            self.proc.wait()


def stop_with_parent() -> None:
    """In the trainer child: SIGTERM when the server that started it dies (Linux), so that a
    restarted server never finds a second trainer on its database and checkpoint folder."""
    parent = os.environ.get(PARENT_PID_ENV)
    if not parent or sys.platform != "linux":
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != int(parent):  # it died before the request was in place
        logger.warning("the server that started this trainer is gone; stopping")
        raise SystemExit(0)
