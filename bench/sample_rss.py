"""Peak resident memory of rlproxy's processes while something else runs: every `proxy.cli train`
(trainer) and `proxy.cli serve` (server) process, read from /proc every `--every` seconds until
SIGTERM or Ctrl-C, then written as JSON (peaks by process, and the largest of each kind per
sample). Linux only.

    .venv/bin/python bench/sample_rss.py out.json &
    OMP_NUM_THREADS=1 .venv/bin/python bench/agent_proof.py --minutes 10 --eval-every 1000
    kill %1
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from typing import Any


def kind(cmdline: list[str]) -> str | None:
    if "proxy.cli" not in cmdline:
        return None
    for name, word in (("trainer", "train"), ("server", "serve")):
        if word in cmdline:
            return name
    return None


def rss_mb(pid: str | int, field: str = "VmRSS") -> float:
    """A memory figure of `pid` from /proc in MB: `VmRSS` (resident now) or `VmHWM` (its peak)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return 0.0


def sample() -> dict[str, float]:
    """RSS in MB of each rlproxy process now, keyed `kind:pid`."""
    now: dict[str, float] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            name = kind(Path(f"/proc/{pid}/cmdline").read_text().split("\0"))
            if name is not None:
                now[f"{name}:{pid}"] = rss_mb(pid)
        except OSError:  # the process ended between listing and reading
            continue
    return now


def stop(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # SIGTERM as Ctrl-C: the peaks are written on the way out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--every", type=float, default=2.0, help="seconds between samples")
    args = parser.parse_args()
    peaks: dict[str, float] = {}
    series: list[dict[str, Any]] = []
    start = time.monotonic()
    signal.signal(signal.SIGTERM, stop)
    try:
        while True:
            now = sample()
            for key, mb in now.items():
                peaks[key] = max(peaks.get(key, 0.0), mb)
            largest = {
                name: max((mb for key, mb in now.items() if key.startswith(name)), default=0.0)
                for name in ("trainer", "server")
            }
            series.append({"s": round(time.monotonic() - start, 1), **largest})
            time.sleep(args.every)
    except KeyboardInterrupt:
        pass
    args.out.write_text(json.dumps({"peak_rss_mb": peaks, "series": series}))
    print(json.dumps({"peak_rss_mb": peaks}))


if __name__ == "__main__":
    main()
