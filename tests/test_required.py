"""A missing part of the machine is a skip outside CI and a failure in CI (tests/required.py):
the helper, with `CI` set and unset, and the coding-agent tests run as `make test-coding-agents`
runs them, on a PATH without node."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.required import in_ci, missing

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("value", [None, "", "0", "false", "False", "no"])
def test_outside_ci_a_missing_part_is_a_skip_that_says_how_to_get_it(
    monkeypatch: pytest.MonkeyPatch, value: str | None
) -> None:
    if value is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", value)
    assert not in_ci()
    with pytest.raises(pytest.skip.Exception) as caught:
        missing("no haproxy on this machine", "apt-get install haproxy")
    assert str(caught.value) == "no haproxy on this machine: apt-get install haproxy"


@pytest.mark.parametrize("value", ["true", "1", "yes", "TRUE"])
def test_in_ci_a_missing_part_is_a_failure_with_the_reason(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("CI", value)
    assert in_ci()
    with pytest.raises(pytest.fail.Exception) as caught:
        missing("no haproxy on this machine", "apt-get install haproxy")
    message = str(caught.value)
    assert message.startswith("no haproxy on this machine: apt-get install haproxy")
    assert f"CI={value}" in message


def _coding_agents_without_node(ci: str | None) -> subprocess.CompletedProcess[str]:
    """pi's test on the embedded model, as `make test-coding-agents` runs it, on a PATH that
    holds no node or npm (this interpreter is called by its path)."""
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PATH"] = str(REPO / "no-such-folder")
    if ci is not None:
        env["CI"] = ci
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider",
         "-m", "coding_agents", "-k", "embedded and pi",
         "tests/e2e/test_coding_agents.py"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_the_coding_agents_skip_without_node_outside_ci_and_say_how_to_run_them() -> None:
    done = _coding_agents_without_node(None)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "1 skipped" in done.stdout, done.stdout
    assert "node and npm not on PATH" in done.stdout
    assert "make test-coding-agents" in done.stdout and "Node.js 20+" in done.stdout


def test_the_coding_agents_fail_without_node_in_ci() -> None:
    done = _coding_agents_without_node("true")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 error" in done.stdout and "skipped" not in done.stdout, done.stdout
    assert "node and npm not on PATH" in done.stdout and "CI=true" in done.stdout
