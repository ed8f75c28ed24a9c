"""`rlproxy serve` runs the trainer beside it: `rlproxy train` as a child process, supervised.

Both sides of that child live here: the supervisor the runtime starts (`TrainerProcess`) and
what the child does to itself (`lower_priority`, `stop_with_parent`), so the trainer child
imports this module without loading the serving stack or the CLI.

On CPU the trainer needs its own copy of the model and its own interpreter, so serving never
waits on a training step (the GIL and torch's threads would otherwise make every request wait).
The child gets the server's settings through the environment and shares its database and
checkpoint folder; its output goes to `<data-dir>/trainer.log`. It is stopped with the server,
and on Linux it also stops when the server dies without stopping it (SIGKILL, a crash):
`stop_with_parent`, called by the child, asks the kernel for a SIGTERM then.

A child that exits on its own (a crash, a bad configuration) is restarted after a delay that
doubles with each exit in a row, from `RLPROXY_TRAINER_RESTART_S` up to
`RLPROXY_TRAINER_RESTART_MAX_S`; a child that ran for `HEALTHY_RUN_S` (or the longest delay, if
that is longer) counts as healthy, and its next exit starts from the short delay again. Serving
never waits on any of it: the supervisor is one asyncio task that spawns, awaits and sleeps.
`TrainerProcess.status()` (shown by /health under "trainer") says what it is doing, how often it
exited in a row, its last exit code, when it restarts next, and the last lines of its log.
With RLPROXY_TRAINER_PROCESSES > 1 the child is torchrun running N ranks of `rlproxy train`
(`trainer.distributed`); a SIGTERM to it reaches every rank.

Several replicas on one database (`proxy.adapters.deployment`): the child runs only while this
replica holds the trainer lease (`lease` given). Without it the supervisor waits ("standby",
naming the holder) and tries again every third of the lease's length; while the child runs it
renews the lease as often. A renewal that fails (the database unreachable, or no answer within a
third of the lease) is tolerated while the last good one still covers more than a quarter of the
lease; once it does not, or a renewal finds another replica holding the lease, the child gets
SIGTERM and, if it is not gone by an eighth of the lease before the lease can expire, SIGKILL
(its whole process group), so it is gone before another replica may take over. A replica that
dies stops renewing; its child dies with it (`stop_with_parent`) and another replica takes the
lease once it expires.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from proxy.adapters.deployment import LeaseKeeper
from proxy.settings import Settings

logger = logging.getLogger(__name__)

PARENT_PID_ENV = "RLPROXY_TRAINER_PARENT_PID"
LOG_TAIL_LINES = 10
HEALTHY_RUN_S = 60.0
"""A child that ran this long got past its start (model loaded, store open): it was healthy."""
_LOG_TAIL_BYTES = 8192
_LOG_LINE_CHARS = 300


def restart_delay(exits_in_a_row: int, first_s: float, max_s: float) -> float:
    """The wait before restart number `exits_in_a_row` (1, 2, ...): first_s, 2x, 4x, ... max_s."""
    return min(max_s, first_s * 2.0 ** max(0, exits_in_a_row - 1))


@dataclass
class TrainerStatus:
    """What the supervisor knows about its child (a snapshot for /health and the logs)."""

    state: Literal["standby", "starting", "running", "restarting", "stopped"] = "starting"
    """standby: another replica holds the trainer lease (see `lease`)."""
    pid: int | None = None
    started_at: float | None = None
    """Epoch seconds of the current (or last) start."""
    restarts: int = 0
    """Starts after the first one."""
    exits_in_a_row: int = 0
    """Exits without a healthy run between them (what the restart delay grows with)."""
    last_exit_code: int | None = None
    """The child's last exit status (negative: killed by that signal); None before any exit or
    when it could not be started at all (see `last_error`)."""
    last_exit_at: float | None = None
    last_error: str | None = None
    """Why the last start failed, when the command could not even be run."""
    next_restart_at: float | None = None
    restart_delay_s: float | None = None
    log: str = ""
    log_tail: list[str] = field(default_factory=list)
    """The last lines of the log after the last exit (credentials scrubbed)."""
    lease: dict[str, Any] | None = None
    """The trainer lease: its name, this replica, whether it holds it, the holder (None when
    the supervisor runs without one)."""


class TrainerProcess:
    """Start with `start()` inside a running event loop; `await stop()` on shutdown."""

    def __init__(
        self,
        settings: Settings,
        redact: Callable[[str], str] = str,
        *,
        healthy_run_s: float | None = None,
        lease: LeaseKeeper | None = None,
    ) -> None:
        self.settings = settings
        self.lease = lease
        self.redact = redact
        self.healthy_run_s = (
            max(HEALTHY_RUN_S, settings.trainer.restart_max_s)
            if healthy_run_s is None
            else healthy_run_s
        )
        self.log_path: Path = settings.data_dir / "trainer.log"
        self.proc: asyncio.subprocess.Process | None = None
        self._status = TrainerStatus(log=str(self.log_path))
        self._task: asyncio.Task[None] | None = None
        if lease is not None:
            self._status.lease = {"name": lease.name, "replica": lease.holder, "held": False}

    def command(self) -> list[str]:
        if self.settings.trainer.command:
            return list(self.settings.trainer.command)
        if self.settings.trainer.processes > 1:  # data-parallel: trainer.distributed
            n = str(self.settings.trainer.processes)
            launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
            return [*launcher, "--nproc-per-node", n, "-m", "proxy.cli", "train"]
        return [sys.executable, "-m", "proxy.cli", "train"]

    def environment(self) -> dict[str, str]:
        s = self.settings
        env = {
            **os.environ,
            "RLPROXY_DATA_DIR": str(s.data_dir),
            "RLPROXY_MODEL_NAME": s.model_name,
            "RLPROXY_DATABASE_URL": s.resolved_database_url,
        }
        env["RLPROXY_TRAIN_THREADS"] = str(s.trainer.threads or 1)
        env["RLPROXY_TRAINER_NICE"] = str(s.trainer.nice)  # the child lowers its own priority
        env[PARENT_PID_ENV] = str(os.getpid())  # the child stops when this process dies
        if s.model_dir is not None:
            env["RLPROXY_MODEL_DIR"] = str(s.model_dir)
        return env

    def start(self) -> None:
        self._task = asyncio.create_task(self._supervise(), name="rlproxy-trainer-supervisor")

    def status(self) -> dict[str, Any]:
        return asdict(self._status)

    async def stop(self, timeout_s: float = 15.0) -> None:
        """Stop restarting, then SIGTERM the child (SIGKILL if it is not gone in `timeout_s`)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._status.state, self._status.next_restart_at = "stopped", None
        proc = self.proc
        if proc is not None and proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), timeout_s)
            except TimeoutError:
                logger.warning("trainer did not stop in %.0f s; killing it", timeout_s)
                _kill_group(proc)
                await proc.wait()
        if self.lease is not None:  # also when the child had already exited (between restarts)
            await self.lease.release()
            self._note_lease(None)

    # --- the trainer lease -----------------------------------------------------------------

    def _note_lease(self, holder: str | None) -> None:
        if self.lease is not None and self._status.lease is not None:
            self._status.lease.update(held=self.lease.held, holder=holder)

    async def _wait_for_lease(self) -> None:
        """Return once this replica holds the trainer lease ("standby" until then)."""
        lease = self.lease
        if lease is None:
            return
        while not await lease.tick():
            try:
                held = await lease.store.get_lease(lease.name)
            except Exception:
                held = None
            self._status.state, self._status.pid = "standby", None
            self._note_lease(held.holder if held is not None else None)
            await asyncio.sleep(lease.renew_every_s)
        self._note_lease(lease.holder)

    async def _keep_lease(self) -> None:
        """Renew the trainer lease while the child runs; return when it is lost: another
        replica holds it, or renewals failed until its time ran out (`LeaseKeeper`)."""
        lease = self.lease
        if lease is None:
            await asyncio.Event().wait()  # never lost
            return
        while True:
            # wake at the next renewal, or earlier when the lease's time runs out first
            await asyncio.sleep(max(0.0, min(lease.renew_every_s, lease.seconds_left())))
            if not lease.still_held() or not await lease.tick():
                self._note_lease(None)
                return

    # --- supervision -----------------------------------------------------------------------

    async def _supervise(self) -> None:
        s, st = self.settings, self._status
        while True:
            await self._wait_for_lease()
            started = time.monotonic()
            code, error = await self._run_once()
            ran_s = time.monotonic() - started
            if ran_s >= self.healthy_run_s:
                st.exits_in_a_row = 0  # it was healthy: a new failure starts from the short delay
            st.exits_in_a_row += 1
            delay = restart_delay(st.exits_in_a_row, s.trainer.restart_s, s.trainer.restart_max_s)
            st.state, st.pid = "restarting", None
            st.last_exit_code, st.last_exit_at, st.last_error = code, time.time(), error
            st.restart_delay_s, st.next_restart_at = delay, time.time() + delay
            st.log_tail = self._log_tail()
            logger.error(
                "trainer %s after %.1f s (%d in a row); restarting in %.1f s. Its log is %s; "
                "last lines:\n%s",
                f"exited with code {code}" if error is None else f"could not start ({error})",
                ran_s,
                st.exits_in_a_row,
                delay,
                self.log_path,
                "\n".join(f"    {line}" for line in st.log_tail) or "    (empty)",
            )
            await asyncio.sleep(delay)
            st.restarts += 1

    async def _run_once(self) -> tuple[int | None, str | None]:
        """Start the child and wait for it to exit: (exit code, None), or (None, why it could
        not start)."""
        st = self._status
        st.state, st.next_restart_at, st.started_at = "starting", None, time.time()
        command = self.command()
        try:
            with self.log_path.open("ab") as log:
                stamp = time.strftime("%Y-%m-%d %H:%M:%S")
                log.write(f"--- rlproxy serve: trainer start at {stamp} ---\n".encode())
                log.flush()
                self.proc = await asyncio.create_subprocess_exec(
                    *command,
                    env=self.environment(),
                    stdout=log,
                    stderr=asyncio.subprocess.STDOUT,
                    stdin=asyncio.subprocess.DEVNULL,
                    start_new_session=True,  # a Ctrl-C on the server's terminal reaches us only
                )
        except OSError as e:
            return None, f"{type(e).__name__}: {e}"
        st.state, st.pid = "running", self.proc.pid
        logger.info("trainer started (pid %d); its log is %s", self.proc.pid, self.log_path)
        exited = asyncio.ensure_future(self.proc.wait())
        lost = asyncio.ensure_future(self._keep_lease())
        try:
            await asyncio.wait({exited, lost}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            lost.cancel()
        if not exited.done():
            # It must be gone before another replica can take the lease: SIGTERM, and SIGKILL
            # (the whole process group: torchrun's ranks too) once that time is up.
            grace = self.lease.kill_by_s() if self.lease is not None else 30.0
            logger.error(
                "the trainer lease was lost; stopping the trainer (pid %d, %.1f s to exit)",
                st.pid,
                grace,
            )
            self.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(asyncio.shield(exited), grace)
            except TimeoutError:
                _kill_group(self.proc)
        return await exited, None

    def _log_tail(self) -> list[str]:
        try:
            with self.log_path.open("rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - _LOG_TAIL_BYTES))
                text = f.read().decode("utf-8", errors="replace")
        except OSError as e:
            return [f"(the log could not be read: {e})"]
        lines = [line for line in text.splitlines() if line.strip()][-LOG_TAIL_LINES:]
        return [self.redact(line[:_LOG_LINE_CHARS]) for line in lines]


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    """SIGKILL the child and everything in its process group (it was started in a new session:
    with torchrun, its ranks)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()


def lower_priority(nice: int) -> int:
    """In serve's trainer child: run every thread of this process at niceness `nice` or lower
    priority (Linux keeps a niceness per thread: threads started before this call, such as a
    thread pool, are set one by one; later ones inherit it). Returns the niceness now."""
    tasks = Path("/proc/self/task")
    tids = [int(t.name) for t in tasks.iterdir()] if tasks.is_dir() else [0]
    for tid in tids:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
        except OSError as e:  # a thread that ended meanwhile; or no permission (cannot be)
            logger.warning("could not lower the priority of thread %d to nice %d: %s", tid, nice, e)
    return os.getpriority(os.PRIO_PROCESS, 0)


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
