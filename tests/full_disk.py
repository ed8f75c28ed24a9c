"""A real full disk for tests: a small tmpfs, and a file of zeros that fills it to ENOSPC.

Mounting needs root (CI and the development machine run the tests as root); where it cannot
mount, `small_tmpfs` skips the test and says why, or fails in CI (tests/required.py).
"""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.required import missing

TMPFS_BYTES = 8 * 2**20


@contextmanager
def small_tmpfs(mount_point: Path, size: int = TMPFS_BYTES) -> Iterator[Path]:
    """Mount a tmpfs of `size` bytes on the (empty) folder `mount_point`; unmount on exit."""
    mount_point.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        missing("not root", "filling a real disk needs a tmpfs mount, and mounting needs root")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        missing(
            f"this machine cannot mount a tmpfs ({done.stderr.strip()})",
            "run the tests as root on a machine (or a container with CAP_SYS_ADMIN) that can",
        )
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=True)


def fill(directory: Path) -> Path:
    """Write zeros into `directory` until its filesystem answers ENOSPC; return the file."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for size in (2**16, 2**12, 1):  # big pieces, then the last pages, then the last bytes
            while True:
                try:
                    if os.write(fd, b"\0" * size) < size:
                        break
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise
                    break
    finally:
        os.close(fd)
    return filler
