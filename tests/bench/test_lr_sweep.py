"""bench/lr_sweep.py's summary of one rate's run: a version whose every held-out answer scored
the same has collapsed, and its gain in standard errors (its own s.e. is 0) is not a gain."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import lr_sweep


def _eval(version: int, reward: float, stderr: float, exact: float) -> dict[str, Any]:
    return {
        "version": version,
        "train_minutes": version / 4,
        "mean_reward": reward,
        "stderr": stderr,
        "exact": exact,
        "greedy": {"exact": exact},
    }


def _run(*evals: dict[str, Any]) -> dict[str, Any]:
    base, last = evals[0], evals[-1]
    gain = last["mean_reward"] - base["mean_reward"]
    se = (base["stderr"] ** 2 + last["stderr"] ** 2) ** 0.5
    return {
        "steps": last["version"],
        "gain": gain,
        "gain_in_standard_errors": gain / se,
        "minutes_to_3_standard_errors": None,
        "evals": list(evals),
    }


def test_a_run_whose_last_version_scores_every_answer_the_same_is_marked_collapsed() -> None:
    run = _run(_eval(0, 0.058, 0.0066, 0.0), _eval(8, 0.213, 0.0046, 0.0), _eval(14, 0.25, 0, 0))
    summary = lr_sweep.summarise(run)
    assert summary["collapsed"] is True
    assert "every held-out answer" in lr_sweep.verdict(summary)


def test_a_run_that_learns_is_not_marked_collapsed() -> None:
    run = _run(_eval(0, 0.063, 0.007, 0.0), _eval(27, 0.392, 0.021, 0.19))
    summary = lr_sweep.summarise(run)
    assert summary["collapsed"] is False
    assert lr_sweep.verdict(summary) == "+14.9 s.e."
