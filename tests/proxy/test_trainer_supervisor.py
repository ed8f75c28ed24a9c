"""The trainer child's supervisor: restarts with capped exponential backoff, reports its state,
stops cleanly. Real child processes (this interpreter running a one-line script) stand in for
`rlproxy train` through `RLPROXY_TRAINER_COMMAND`; the server-level test (a crash loop beside a
serving server, seen through /health) is in tests/e2e/test_faults.py.

Nothing here waits for a fixed time: each test waits for a state the supervisor reaches.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path

import pytest

from proxy.settings import Settings
from proxy.trainer_child import TrainerProcess, restart_delay

pytestmark = pytest.mark.asyncio(loop_scope="function")

CRASH = [sys.executable, "-c", "import sys; print('trainer boom: bad config'); sys.exit(3)"]


def _settings(tmp_path: Path, command: list[str], first_s: float, max_s: float) -> Settings:
    return Settings(
        data_dir=tmp_path,
        trainer={"command": command, "restart_s": first_s, "restart_max_s": max_s},
    )


async def _until(trainer: TrainerProcess, key: str, at_least: int) -> None:
    while trainer.status()[key] < at_least:
        await asyncio.sleep(0.01)


def _exit_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "proxy.trainer_child" and "after" in r.msg]


async def test_the_delay_doubles_from_the_first_and_stops_at_the_cap() -> None:
    assert [restart_delay(n, 1.0, 10.0) for n in range(1, 7)] == [1, 2, 4, 8, 10, 10]


async def test_a_crashing_trainer_is_restarted_with_capped_backoff(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="proxy.trainer_child")
    trainer = TrainerProcess(_settings(tmp_path, CRASH, first_s=0.01, max_s=0.04))
    trainer.start()
    try:
        await _until(trainer, "exits_in_a_row", 5)
    finally:
        await trainer.stop()
    # Every exit is logged with its count and the delay chosen: 0.01, 0.02, 0.04, then the cap.
    exits = _exit_records(caplog)
    assert [r.args[2] for r in exits[:5]] == [1, 2, 3, 4, 5]  # type: ignore[index]
    assert [r.args[3] for r in exits[:5]] == [0.01, 0.02, 0.04, 0.04, 0.04]  # type: ignore[index]
    assert all("code 3" in str(r.args[0]) for r in exits)  # type: ignore[index]
    status = trainer.status()
    assert status["state"] == "stopped" and status["last_exit_code"] == 3
    assert status["restarts"] >= 4 and status["log"] == str(tmp_path / "trainer.log")
    assert "trainer boom: bad config" in status["log_tail"]
    assert any(line.startswith("--- rlproxy serve: trainer start") for line in status["log_tail"])


async def test_a_healthy_run_resets_the_backoff(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="proxy.trainer_child")
    # Each run lasts longer than a healthy run, so each exit is the first of a new series.
    slow_crash = [sys.executable, "-c", "import time, sys; time.sleep(0.3); sys.exit(1)"]
    settings = _settings(tmp_path, slow_crash, first_s=0.01, max_s=0.2)
    trainer = TrainerProcess(settings, healthy_run_s=0.2)
    trainer.start()
    try:
        await _until(trainer, "restarts", 3)
    finally:
        await trainer.stop()
    assert {r.args[2] for r in _exit_records(caplog)} == {1}  # type: ignore[index]
    assert {r.args[3] for r in _exit_records(caplog)} == {0.01}  # type: ignore[index]


async def test_a_command_that_cannot_start_is_retried_and_says_why(tmp_path: Path) -> None:
    missing = [str(tmp_path / "no-such-trainer")]
    trainer = TrainerProcess(_settings(tmp_path, missing, first_s=0.01, max_s=0.02))
    trainer.start()
    try:
        await _until(trainer, "exits_in_a_row", 2)
    finally:
        await trainer.stop()
    status = trainer.status()
    assert status["last_exit_code"] is None
    assert "FileNotFoundError" in status["last_error"]


async def test_stop_ends_a_running_trainer(tmp_path: Path) -> None:
    forever = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(600)"]
    trainer = TrainerProcess(_settings(tmp_path, forever, first_s=0.01, max_s=0.02))
    trainer.start()
    while trainer.status()["state"] != "running":
        await asyncio.sleep(0.01)
    assert trainer.status()["pid"] == trainer.proc.pid  # type: ignore[union-attr]
    await trainer.stop()
    assert trainer.proc is not None and trainer.proc.returncode is not None
    assert trainer.status()["state"] == "stopped" and trainer.status()["exits_in_a_row"] == 0


async def test_the_log_tail_is_scrubbed(tmp_path: Path) -> None:
    leak = [sys.executable, "-c", "print('connecting with key sk-abcdefgh12345678'); exit(2)"]
    from proxy.redact import Redactor

    trainer = TrainerProcess(_settings(tmp_path, leak, first_s=10, max_s=10), redact=Redactor())
    trainer.start()
    try:
        await _until(trainer, "exits_in_a_row", 1)
    finally:
        await trainer.stop()
    tail = "\n".join(trainer.status()["log_tail"])
    assert "connecting with key [REDACTED]" in tail and "sk-abcdefgh" not in tail


async def test_only_the_lease_holder_runs_a_trainer_and_a_lost_lease_stops_it(
    tmp_path: Path,
) -> None:
    """Two supervisors (two replicas) on one SQLite database: one runs its child, the other
    stands by naming the holder. When the holder's lease is taken from it (it expired and a
    third replica took it, as after a stall) its child is stopped; when that one lets it go, one
    of the two runs again, and when it stops cleanly (the lease given up) the other starts."""
    import time

    from proxy.adapters.deployment import LeaseKeeper
    from storage import Store

    forever = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(600)"]
    (tmp_path / "b").mkdir()
    store = await Store.open(f"sqlite+aiosqlite:///{tmp_path / 'rlproxy.db'}")
    a = TrainerProcess(
        _settings(tmp_path, forever, first_s=0.01, max_s=0.02),
        lease=LeaseKeeper(store, "trainer:p", "A", ttl_s=0.3),
    )
    b = TrainerProcess(
        _settings(tmp_path / "b", forever, first_s=0.01, max_s=0.02),
        lease=LeaseKeeper(store, "trainer:p", "B", ttl_s=0.3),
    )
    try:
        a.start()
        while a.status()["state"] != "running":
            await asyncio.sleep(0.01)
        b.start()
        while b.status()["state"] != "standby":
            await asyncio.sleep(0.01)
        assert b.status()["lease"] == {
            "name": "trainer:p",
            "replica": "B",
            "held": False,
            "holder": "A",
        }
        assert a.status()["lease"]["held"] is True and a.status()["lease"]["holder"] == "A"
        # C takes the lease as if A's had expired (its clock says A's expiry is long past).
        first = a.proc
        assert first is not None
        assert await store.acquire_lease("trainer:p", "C", 3600, now=time.time() + 60)
        while first.returncode is None:  # A's next renewal fails: its child is stopped
            await asyncio.sleep(0.01)
        assert a.status()["lease"]["held"] is False and b.status()["state"] == "standby"
        assert await store.release_lease("trainer:p", "C")
        running = [t for t in (a, b) if t.status()["state"] == "running"]
        while not running:  # the first to tick takes it
            await asyncio.sleep(0.01)
            running = [t for t in (a, b) if t.status()["state"] == "running"]
        holder, other = (a, b) if running == [a] else (b, a)
        assert len(running) == 1 and other.status()["state"] in ("standby", "restarting")
        await holder.stop()  # a clean stop gives the lease up: the other one takes over
        while other.status()["state"] != "running":
            await asyncio.sleep(0.01)
        assert other.status()["lease"]["held"] is True
    finally:
        await a.stop()
        await b.stop()
        await store.close()


async def test_stop_gives_the_lease_up_even_when_the_child_had_already_exited(
    tmp_path: Path,
) -> None:
    """Between restarts (the child crashed, the next start waits) a clean stop still hands the
    trainer lease to another replica at once instead of leaving it to expire."""
    from proxy.adapters.deployment import LeaseKeeper
    from storage import Store

    store = await Store.open(f"sqlite+aiosqlite:///{tmp_path / 'rlproxy.db'}")
    try:
        trainer = TrainerProcess(
            _settings(tmp_path, CRASH, first_s=600, max_s=600),
            lease=LeaseKeeper(store, "trainer:p", "A", ttl_s=600),
        )
        trainer.start()
        await _until(trainer, "exits_in_a_row", 1)
        assert (await store.get_lease("trainer:p")) is not None
        await trainer.stop()
        assert await store.get_lease("trainer:p") is None
        assert trainer.status()["lease"]["held"] is False
    finally:
        await store.close()


async def test_a_trainer_that_ignores_sigterm_is_killed_before_its_lease_can_expire(
    tmp_path: Path,
) -> None:
    """The lease's time runs out without a renewal (the test moves the lease's clock past it, as
    after stuck renewals): the child gets SIGTERM, ignores it, and is SIGKILLed an eighth of the
    lease before another replica could take the lease, not after a fixed 30 s."""
    import signal

    from proxy.adapters.deployment import LeaseKeeper
    from storage import Store

    stubborn = [
        sys.executable,
        "-c",
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('up', flush=True); time.sleep(600)",
    ]
    now = [1000.0]
    store = await Store.open(f"sqlite+aiosqlite:///{tmp_path / 'rlproxy.db'}")
    lease = LeaseKeeper(store, "trainer:p", "A", ttl_s=0.3, clock=lambda: now[0])
    trainer = TrainerProcess(_settings(tmp_path, stubborn, first_s=600, max_s=600), lease=lease)
    try:
        trainer.start()
        log = tmp_path / "trainer.log"
        while trainer.proc is None or "up" not in log.read_text():  # SIGTERM is ignored now
            await asyncio.sleep(0.01)
        child = trainer.proc
        assert child is not None
        now[0] += 0.25  # past valid_until - margin (0.3 - 0.075): no longer the holder
        while child.returncode is None:
            await asyncio.sleep(0.01)
        assert child.returncode == -signal.SIGKILL
        assert trainer.status()["lease"]["held"] is False
    finally:
        await trainer.stop()
        await store.close()
