"""A redis-server of a test's own on a free loopback port (no persistence), for tests that stop
Redis under rlproxy: `with redis_server() as (url, proc): ...; proc.kill()`. Debian's
`redis-server` (installed here and in CI beside the shared server on 6379; without it a test
skips, or fails in CI: tests/required.py)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager

from tests.required import missing


@contextmanager
def redis_server() -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    binary = shutil.which("redis-server")
    if binary is None:
        missing("no redis-server on this machine", "apt-get install redis-server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:  # until it accepts connections
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on {port} did not start") from None
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0", proc
    finally:
        proc.kill()
        proc.wait()
