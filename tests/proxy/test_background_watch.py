"""What background work costs (`proxy.telemetry.background`) and the trainer child's priority
(`proxy.trainer_child.lower_priority`), read from this machine's real `/proc`."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from proxy.telemetry.background import BackgroundWatch, Rates, cpu_seconds, niceness
from proxy.telemetry.waiting import placeholder_cost
from storage.stats import JudgeWork


def test_rates_are_growth_per_second_over_the_window() -> None:
    rates = Rates(window_s=60)
    rates.add(0.0, {"a": 10.0, "b": None})
    rates.add(10.0, {"a": 15.0, "b": 1.0})
    rates.add(20.0, {"a": 30.0, "b": 2.0})
    assert rates.per_second("a") == 1.0  # (30 - 10) / 20
    assert rates.per_second("b") == 0.1  # only the samples that hold it
    rates.add(100.0, {"a": 40.0, "b": 3.0})  # the first two fall out of the window
    assert rates.per_second("a") == round(10 / 80, 3)
    rates.add(110.0, {"a": 1.0, "b": 3.0})  # a counter that went back: a new process
    assert rates.per_second("a") is None
    assert Rates().per_second("a") is None


def test_cpu_time_and_niceness_are_read_from_proc() -> None:
    before = cpu_seconds(os.getpid())
    sum(i * i for i in range(2_000_000))  # burn a little CPU
    after = cpu_seconds(os.getpid())
    assert before is not None and after is not None and after > before
    assert niceness(os.getpid()) == os.getpriority(os.PRIO_PROCESS, 0)
    assert cpu_seconds(2**22 + 12345) is None  # no such process


def test_lower_priority_reaches_threads_started_before_and_after() -> None:
    script = textwrap.dedent(
        """
        import os, threading, time
        from pathlib import Path
        from proxy.trainer_child import lower_priority

        stop = threading.Event()
        early = threading.Thread(target=stop.wait)
        early.start()
        print(lower_priority(7))
        late = threading.Thread(target=stop.wait)
        late.start()
        time.sleep(0.1)
        nice = {
            int(p.name): int((p / "stat").read_text().rsplit(")", 1)[1].split()[16])
            for p in Path("/proc/self/task").iterdir()
        }
        stop.set()
        print(sorted(set(nice.values())), len(nice))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    ).stdout.split("\n")
    assert out[0] == "7"
    assert out[1].startswith("[7] ")  # every thread, the early one and the late one
    assert int(out[1].split()[-1]) >= 3


def test_the_watch_reports_engine_judge_and_trainer() -> None:
    clock = iter(float(t) for t in range(0, 1000, 5))
    busy = {"busy_s": 0.0}
    watch = BackgroundWatch(
        engine_background=lambda: dict(busy),
        trainer_pid=os.getpid,  # this process stands in for the trainer child
        judge=lambda: {"state": "idle"},
        clock=lambda: next(clock),
    )
    watch.sample()
    busy["busy_s"] = 2.5
    watch.sample()
    report = watch.report()
    assert report["engine_background_share"] == 0.5  # 2.5 s of engine time in 5 s
    assert report["judge"] == {"state": "idle"}
    assert report["trainer"]["pid"] == os.getpid()
    assert report["trainer"]["nice"] == os.getpriority(os.PRIO_PROCESS, 0)
    assert report["trainer"]["cpu_cores"] is not None
    assert report["server_cpu_cores"] is not None


def test_the_placeholder_judges_cost_is_stated() -> None:
    measured = placeholder_cost(JudgeWork(since=0.0, groups=3, calls=6, seconds=95.4))
    assert "3 groups in 6 calls, 95 s of the engine's time" in measured
    assert "only while no user's request waits" in measured
    assert "one to four judge calls" in placeholder_cost(None)
