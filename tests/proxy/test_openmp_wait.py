"""The command line makes OpenMP threads sleep while they wait, unless the user chose otherwise,
and does it before torch (and with it libgomp) is loaded."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from proxy.cli.openmp import prefer_passive_waits

REPO = Path(__file__).resolve().parents[2]

# Runs the real `rlproxy --help` in a fresh interpreter, then reports what libgomp would read.
PROBE = """
import os, sys
from proxy.cli.main import main
try:
    main(["--help"])
except SystemExit:
    pass
print(os.environ.get("OMP_WAIT_POLICY"), os.environ.get("GOMP_SPINCOUNT"), "torch" in sys.modules)
"""


def probe(**env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        env={**clean, **env},
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.split()[-3:]


def test_passive_is_set_when_the_user_chose_nothing() -> None:
    env: dict[str, str] = {}
    assert prefer_passive_waits(env) is True
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}


def test_a_users_policy_or_spin_count_is_left_alone() -> None:
    for chosen in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "300000"}):
        env = dict(chosen)
        assert prefer_passive_waits(env) is False
        assert env == chosen


def test_the_command_line_sets_it_before_torch_is_imported() -> None:
    assert probe() == ["PASSIVE", "None", "False"]


def test_the_command_line_keeps_the_users_choice() -> None:
    assert probe(OMP_WAIT_POLICY="ACTIVE") == ["ACTIVE", "None", "False"]
    assert probe(GOMP_SPINCOUNT="300000") == ["None", "300000", "False"]
