"""The trainer's glibc heap settings (`trainer.peft_backend`): that they take effect, checked in
a process of their own (they are process-wide), and that one that does not is said out loud."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import subprocess
import sys
import textwrap

import pytest

from trainer import peft_backend
from trainer.peft_backend import mallopt

LIBC = ctypes.util.find_library("c")
glibc_only = pytest.mark.skipif(
    LIBC is None or not hasattr(ctypes.CDLL(LIBC), "mallinfo2"),
    reason="needs glibc 2.33 or later (mallinfo2)",
)

# A fresh interpreter allocates 2 MiB with malloc and reports whether glibc served it from
# pages of its own (mallinfo2's count of mmapped blocks, `hblks`, went up), after
# `set_mmap_threshold(argv[1])` when one is given.
PROBE = textwrap.dedent(
    """
    import ctypes, ctypes.util, logging, sys

    from trainer.peft_backend import set_mmap_threshold

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd",
            "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
        )]

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.mallinfo2.restype = MallInfo2
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
    if len(sys.argv) > 1:
        print("took effect:", set_mmap_threshold(int(sys.argv[1])))
    before = libc.mallinfo2().hblks
    block = libc.malloc(2 * 1024 * 1024)
    print("mmapped:", libc.mallinfo2().hblks - before)
    """
)


def _probe(*args: str) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


@glibc_only
def test_the_mmap_threshold_takes_effect_and_is_reported() -> None:
    """glibc's default threshold (128 KiB, raised as mmapped blocks are freed) gives a 2 MiB
    block pages of its own; at a 4 MiB threshold the same block comes from the heap."""
    assert _probe() == ["mmapped: 1"]
    assert _probe(str(4 * 1024 * 1024)) == [
        "glibc malloc: M_MMAP_THRESHOLD set to 4194304",
        "took effect: True",
        "mmapped: 0",
    ]


@glibc_only
def test_a_setting_glibc_refuses_is_reported_not_silent(caplog: pytest.LogCaptureFixture) -> None:
    """mallopt returns 0 for a setting it refuses: glibc caps M_MXFAST (parameter 1) at 160
    bytes on 64-bit, so asking for 10000 fails for real (and changes nothing)."""
    with caplog.at_level(logging.WARNING, logger="trainer.peft_backend"):
        assert mallopt(1, 10_000, "M_MXFAST") is False
    assert [r.getMessage() for r in caplog.records] == [
        "mallopt(M_MXFAST, 10000) did not take effect: glibc refused it"
    ]


def test_a_c_library_without_mallopt_is_reported(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A C library that is not glibc (musl) has no mallopt; this machine's has, so the lookup
    is made to find none."""
    monkeypatch.setattr(peft_backend, "_glibc", lambda function, *args: None)
    with caplog.at_level(logging.WARNING, logger="trainer.peft_backend"):
        assert peft_backend.set_mmap_threshold(1024 * 1024) is False
    assert [r.getMessage() for r in caplog.records] == [
        "mallopt(M_MMAP_THRESHOLD, 1048576) did not take effect: the C library has no mallopt "
        "(not glibc)"
    ]
