"""What background work runs beside serving, and what it costs, for `GET /rl/stats`.

Serving comes first: the local judge's requests run on the engine only while no user's request
runs or waits (`proxy.engines.local`), the trainer child runs at a lower CPU priority
(`RLPROXY_TRAINER_NICE`), and a judge that cannot help stops judging (`trainer.scoring.scoring`).
This module reads what each of them is doing and samples, every few seconds, the CPU time of the
server and of the trainer child (Linux `/proc`) and the engine's time on background rows, so the
report can say how much of the machine each took over the last minute:

    watch = BackgroundWatch(engine_background=..., trainer_pid=..., judge=...)
    task = asyncio.create_task(watch.run())     # samples every `interval_s`
    watch.report()                               # plain JSON values

CPU shares are in cores (1.0: one core busy all the time); None where they cannot be read.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

WINDOW_S = 60.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of `/proc/<pid>/stat` after the command name (field 3 on); None if gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def cpu_seconds(pid: int) -> float | None:
    """User and system CPU time of a process, all its threads, in seconds."""
    fields = _stat_fields(pid)
    if fields is None:
        return None
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime (fields 14, 15)


def niceness(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return None if fields is None else int(fields[16])  # field 19


class Rates:
    """Counters sampled over time; each one's rate of growth over the newest `window_s`."""

    def __init__(self, window_s: float = WINDOW_S) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, dict[str, float | None]]] = deque()

    def add(self, now: float, values: dict[str, float | None]) -> None:
        self._samples.append((now, values))
        while len(self._samples) > 2 and self._samples[1][0] <= now - self.window_s:
            self._samples.popleft()

    def per_second(self, name: str) -> float | None:
        """Growth per second between the oldest and newest samples that both hold `name`."""
        held = [(t, v[name]) for t, v in self._samples if v.get(name) is not None]
        if len(held) < 2 or held[-1][0] <= held[0][0]:
            return None
        (t0, v0), (t1, v1) = held[0], held[-1]
        assert v0 is not None and v1 is not None
        if v1 < v0:  # a new process under the same name (the trainer restarted)
            return None
        return round((v1 - v0) / (t1 - t0), 3)


class BackgroundWatch:
    def __init__(
        self,
        *,
        engine_background: Callable[[], dict[str, Any] | None],
        trainer_pid: Callable[[], int | None],
        judge: Callable[[], dict[str, Any] | None],
        interval_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine_background = engine_background
        self.trainer_pid = trainer_pid
        self.judge = judge
        self.interval_s = interval_s
        self.clock = clock
        self.rates = Rates()
        self._trainer_seen: int | None = None

    def sample(self) -> None:
        pid = self.trainer_pid()
        if pid != self._trainer_seen:  # another child: its CPU time starts again from 0
            self.rates = Rates(self.rates.window_s)
            self._trainer_seen = pid
        engine = self.engine_background() or {}
        self.rates.add(
            self.clock(),
            {
                "server": cpu_seconds(os.getpid()),
                "trainer": cpu_seconds(pid) if pid else None,
                "engine_background": engine.get("busy_s"),
            },
        )

    async def run(self) -> None:
        while True:
            try:
                self.sample()
            except Exception:
                logger.exception("sampling the background work's CPU failed; trying again")
            await asyncio.sleep(self.interval_s)

    def report(self) -> dict[str, Any]:
        pid = self.trainer_pid()
        return {
            "window_s": self.rates.window_s,
            "cores": os.cpu_count(),
            "server_cpu_cores": self.rates.per_second("server"),
            "engine": self.engine_background(),
            "engine_background_share": self.rates.per_second("engine_background"),
            "judge": self.judge(),
            "trainer": {
                "pid": pid,
                "nice": niceness(pid) if pid else None,
                "cpu_cores": self.rates.per_second("trainer") if pid else None,
            },
        }
